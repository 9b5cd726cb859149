"""Probe: how much this machine's speed drifts over the minutes a benchmark takes.

`weightstream tune` calibrates once and predicts runs that follow over the next minutes; a benchmark compares
configurations measured minutes apart. Both assume the machine runs the same work at the same speed meanwhile. This
probe checks that assumption: every `--every` seconds it times a fixed decode-like workload (batch-1 bf16
matrix-vector products over `--weights-mib` of weights, the memory-bound shape of an MoE decode step) for
`--window` seconds, and reads the CPU time the hypervisor took (steal, /proc/stat) over the same window.

    .venv/bin/python benchmarks/machine_drift.py --minutes 20 --every 30 > drift.json

Run it alone on an otherwise idle machine. It prints one JSON object: each sample (seconds since start, passes
per second, steal share) and the spread of the speed over the whole run and over windows as long as one tune
proof case (about 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])


def sample(weights: list[torch.Tensor], x: torch.Tensor, window_s: float) -> dict:
    steal0, total0 = cpu_times()
    passes, start = 0, time.perf_counter()
    while time.perf_counter() - start < window_s:
        for w in weights:
            torch.mv(w, x)
        passes += 1
    elapsed = time.perf_counter() - start
    steal1, total1 = cpu_times()
    return {
        "passes_per_s": passes / elapsed,
        "steal_share": (steal1 - steal0) / max(total1 - total0, 1),
    }


def probe_workload(weights_mib: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """bf16 matrices of one OLMoE expert projection's shape, `weights_mib` in all, and the vector they multiply."""
    rows, cols = 2048, 1024
    n = max(weights_mib * 2**20 // (rows * cols * 2), 1)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for _ in range(n)]
    return weights, torch.randn(cols, generator=gen).to(torch.bfloat16)


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="how long to watch (default 20)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples' starts (default 30)")
    ap.add_argument("--window", type=float, default=3.0, help="seconds of work per sample (default 3)")
    ap.add_argument("--weights-mib", type=int, default=512, help="bf16 weights swept per pass (default 512)")
    ap.add_argument("--threads", type=int, default=2, help="torch compute threads (default 2, as the benchmarks)")
    ap.add_argument("--case-minutes", type=float, default=10.0, help="window for the per-case spread (default 10)")
    args = ap.parse_args()
    if args.window >= args.every:
        ap.error(f"--window {args.window:g} must be shorter than --every {args.every:g}")
    torch.set_num_threads(args.threads)
    weights, x = probe_workload(args.weights_mib)
    rows, cols = weights[0].shape
    n = len(weights)
    sample(weights, x, 1.0)  # warm-up: page in the weights, start the thread pool
    samples, start = [], time.perf_counter()
    end = start + args.minutes * 60
    while time.perf_counter() < end:
        t = time.perf_counter() - start
        samples.append({"t_s": round(t, 1), **sample(weights, x, args.window)})
        print(f"{t:7.0f} s  {samples[-1]['passes_per_s']:.3f} passes/s", file=sys.stderr, flush=True)
        time.sleep(max(start + len(samples) * args.every - time.perf_counter(), 0))
    speeds = [s["passes_per_s"] for s in samples]
    case = [
        spread([s["passes_per_s"] for s in samples if a["t_s"] <= s["t_s"] <= a["t_s"] + args.case_minutes * 60])
        for a in samples
        if a["t_s"] + args.case_minutes * 60 <= samples[-1]["t_s"]
    ]
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "workload": {"weights_mib": n * rows * cols * 2 / 2**20, "matrix": [rows, cols], "dtype": "bf16"},
        "settings": vars(args),
        "samples": samples,
        "summary": {
            "median_passes_per_s": statistics.median(speeds),
            "spread_whole_run": spread(speeds),
            "spread_within_case_window_max": max(case) if case else None,
            "spread_within_case_window_median": statistics.median(case) if case else None,
            "steal_share_max": max(s["steal_share"] for s in samples),
        },
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
