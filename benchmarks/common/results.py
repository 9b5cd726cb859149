"""Where benchmark results go: one JSON file per run under `benchmarks/results/`, named by capability."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def default(name: str) -> str:
    """The default result file of a benchmark, `benchmarks/results/NAME`, relative to the current directory
    where it lies below it (so that a report records no absolute path)."""
    path = RESULTS / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def save(text: str, path: str | Path | None) -> None:
    """Write `text` (a JSON document) to `path`, creating its folder; say where on stderr. No path: nothing."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def emit(report: dict, path: str | Path | None, indent: int = 1) -> None:
    """Print `report` as JSON and write it to `path` (see `save`): what every benchmark ends with."""
    text = json.dumps(report, indent=indent)
    print(text)
    save(text, path)
