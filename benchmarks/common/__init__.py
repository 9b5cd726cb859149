"""Shared pieces of the benchmarks in `benchmarks/`: where results go, how an entry point runs one of its named
parts, the machine probe, the prefetch benchmark's checkpoint, loaders and timing, and the parts an entry point
runs by name (`bench_sweep.py predict-next`, `quant_bench.py quality`, `tune_proof.py table`, ...).

Entry points are run as `python benchmarks/SCRIPT.py`, which puts `benchmarks/` on the import path: they import
these as `common.NAME`.
"""

from __future__ import annotations

import importlib
import sys


def run_part(script: str, parts: dict[str, str], argv: list[str] | None = None) -> bool:
    """If the first argument names one of `parts` ({name: module under common}), run that module's `main` with the
    remaining arguments (its usage names `script name`) and return True; else return False: the entry point runs
    its own benchmark."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in parts:
        return False
    module = importlib.import_module(f"common.{parts[argv[0]]}")
    module.main(argv[1:], prog=f"{script} {argv[0]}")
    return True
