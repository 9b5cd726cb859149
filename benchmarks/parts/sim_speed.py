"""Simulator speed on a real trace, on one core, against two baselines measured in the same run.

Prints one JSON object: trace load time, lookups per CPU-second of every policy's fast path at several sizes,
the reference path (the runtime's access_layer + policy objects) and libCacheSim's C replay (one request at a
time, so no layer pinning) as baselines, and the ratios.

    .venv/bin/python benchmarks/simulator.py speed --trace ds.npz [--reference-prompts 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from common.results import default, save

from weightstream.sim import Workload
from weightstream.sim.replay import Options, run_one
from weightstream.trace import load

SIZES = (0.5, 1.0, 2.0, 4.0, 8.0)
POLICIES = ("lru", "slru", "lfu", "pinned", "adaptive", "belady")


CLOCK = time.process_time  # CPU seconds of this process: one core's work, not inflated by other tenants


def timed(fn, repeat=3):
    """Best of `repeat` CPU times (seconds) and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = CLOCK()
        out = fn()
        best = min(best, CLOCK() - t0)
    return best, out


def fast_rates(w: Workload) -> dict:
    """Lookups/s of each policy's fast path at each size; LRU also as one pass serving every size."""
    ws, n = w.trace.shape.working_set_bytes, len(w.keys)
    for name in POLICIES:  # compile (numba caches to disk) and build per-trace facts before timing
        run_one(w, name, int(ws * SIZES[0]))

    def one_size(name, m):
        # Each single-size figure pays for the per-trace work it needs (stack distances, next uses).
        w.__dict__.pop("lru_distances", None)
        w.__dict__.pop("next_use", None)
        return run_one(w, name, int(ws * m))

    rates = {
        name: {f"{m}x": n / timed(lambda name=name, m=m: one_size(name, m))[0] for m in SIZES} for name in POLICIES
    }
    t_pass, _ = timed(lambda: (w.__dict__.pop("lru_distances", None), w.lru_distances))
    t_sizes, _ = timed(lambda: [run_one(w, "lru", int(ws * m)) for m in SIZES])
    rates["lru_all_sizes_one_pass"] = n * len(SIZES) / (t_pass + t_sizes)
    return rates


def reference_rates(trace, prompts: int) -> dict:
    """Lookups/s of the reference path (what the runtime cache runs) on the first `prompts` requests."""
    sub = trace.slice_steps(0, trace.first_step_of_request(prompts))
    w, ws = Workload(sub), sub.shape.working_set_bytes
    return {
        name: sub.n_accesses / timed(lambda name=name: run_one(w, name, int(ws * 2.0), Options(), "reference"), 1)[0]
        for name in POLICIES
    }


def libcachesim_rates(w: Workload) -> dict:
    """Lookups/s of libCacheSim's C replay of the same lookups (flat: one request at a time)."""
    import libcachesim as lcs

    keys, n = w.keys, len(w.keys)
    rec = np.zeros(n, [("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    rec["t"], rec["id"], rec["size"] = np.arange(n), keys.astype(np.uint64) + 1, 1
    rec["next"] = np.where(w.next_use < n, w.next_use, np.iinfo(np.int64).max)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "trace.oracleGeneral")
        rec.tofile(path)
        slots = 2 * w.trace.shape.working_set_slots
        out = {}
        for name, cls in (("lru", lcs.LRU), ("slru", lcs.SLRU), ("lfu", lcs.LFU), ("belady", lcs.Belady)):
            reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
            out[name] = n / timed(lambda cls=cls, reader=reader: cls(slots).process_trace(reader), 1)[0]
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="trace .npz (e.g. the imported DeepSeek-V2-Lite trace)")
    ap.add_argument("--reference-prompts", type=int, default=40, help="requests replayed on the reference path")
    ap.add_argument("--out", default=default("simulator-speed.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    load_before = os.getloadavg()[0]
    t_load, trace = timed(lambda: load(args.trace))
    w = Workload(trace)
    fast = fast_rates(w)
    ref = reference_rates(trace, args.reference_prompts)
    lcs = libcachesim_rates(w)
    text = json.dumps(
        {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python "
            f"{platform.python_version()}",
            "pinned_to_one_core": hasattr(os, "sched_setaffinity"),
            "clock": "process CPU time (best of 3)",
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "trace": args.trace,
            "accesses": trace.n_accesses,
            "load_s": round(t_load, 3),
            "fast_accesses_per_s": {
                k: v if isinstance(v, float) else {s: round(r) for s, r in v.items()} for k, v in fast.items()
            },
            "min_fast_accesses_per_s": round(min(r for v in fast.values() if isinstance(v, dict) for r in v.values())),
            "reference_accesses_per_s_at_2x": {k: round(v) for k, v in ref.items()},
            "libcachesim_c_accesses_per_s_at_2x": {k: round(v) for k, v in lcs.items()},
            "fast_over_reference_at_2x": {k: round(fast[k]["2.0x"] / ref[k], 1) for k in POLICIES},
            "fast_over_libcachesim_at_2x": {k: round(fast[k]["2.0x"] / lcs[k], 2) for k in lcs},
        },
        indent=1,
    )
    print(text)
    save(text, args.out)
