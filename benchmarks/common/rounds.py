"""Back to back against a peer: each side once a round, the order reversed every other round, since these machines
drift by 15-25% over minutes; and the report of such a run against llama.cpp on a GGUF file. What the llama.cpp
comparisons (`llamacpp.py speed`, `serve`, `prefill`) and `kernel_bench.py layer` share."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def alternated(rounds: int, sides: dict[str, Callable[[], dict]], said: Callable[[int, str, dict], None]) -> dict:
    """Run each of `sides` (name -> one run) once a round, in the given order in even rounds and reversed in odd
    ones; said(round, name, result) after each run. Each side's results in round order."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            got = sides[name]()
            runs[name].append(got)
            said(r + 1, name, got)
    return runs


def head(gguf: str, **fields) -> dict:
    """A report's first fields: when (UTC), the GGUF file's name (no path of this machine), then `fields`."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gguf": os.path.basename(gguf), **fields}


def against_llamacpp(report: dict, runs: dict, figure: str, medians: str, higher_is_better: bool) -> dict:
    """`report` with the runs of both sides ("llama.cpp", "weightstream"), the median of `figure` of each under
    `medians`, and ours against llama.cpp's per round and of the medians (above 1: ours is better; a time's ratio
    is llama.cpp's / ours, a speed's ours / llama.cpp's)."""
    values = {who: [got[figure] for got in rs] for who, rs in runs.items()}
    report = report | {"runs": runs, medians: {who: statistics.median(v) for who, v in values.items()}}
    over, under = ("weightstream", "llama.cpp") if higher_is_better else ("llama.cpp", "weightstream")
    report["ratio_per_round"] = [a / b for a, b in zip(values[over], values[under], strict=True)]
    report["ratio"] = report[medians][over] / report[medians][under]
    return report
