"""The native products timed, each measurement in a process of its own (so builds and configurations timed one after
another do not share a process's warm state), against random GGML blocks: what `llamacpp.py products`
(block_types) and `kernel_bench.py layer`, `crossover`, `dequant` (moe_layer) and `routes` (quant_kernels) share.

A child's code is PRELUDE then its own body: `sys.path` set to a build's `src` (another checkout's, for `--against`)
and to `benchmarks/` (this module and common/blocks.py, which need the standard library, numpy and gguf only, so a
child of any build imports them), then numpy, torch, `random_blocks`, the timing below and `native` (from where
that build keeps it).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
SRC = os.path.join(os.path.dirname(BENCH), "src")  # this checkout's
FAILED = "the timed process failed"

PRELUDE = """
import json, statistics, sys, time
{src_path}sys.path.insert(0, {bench!r})
import numpy as np, torch
from common.blocks import random_blocks
from common.products import call_times, median_ms
try:
    from weightstream import native
except ImportError:  # builds from before native.py moved below the packages
    from weightstream.engine import native
"""


def child(body: str, src: str | None = None, failed: str = FAILED, timeout: float | None = None, **fields) -> dict:
    """Run PRELUDE (`src`: a build's src folder, None: the installed one) then `body` formatted with `fields` in a
    process of its own; the JSON object it printed last."""
    from common.child import json_child

    src_path = f"sys.path.insert(0, {src!r})\n" if src else ""
    code = PRELUDE.format(src_path=src_path, bench=BENCH) + body.format(**fields)
    return json_child(code, failed, timeout=timeout)


def call_times(fn: Callable[[], object], calls: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `calls` calls of fn(), after `warmup` untimed ones (the first calls' allocations)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_ms(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    """The median of `calls` timed calls of fn() in milliseconds, after `warmup` untimed ones."""
    return 1e3 * statistics.median(call_times(fn, calls, warmup))
