"""The machine probe: how fast this machine runs a fixed decode-like workload right now.

`weightstream tune` calibrates and then predicts runs that follow over the next minutes; `tune_proof.py` times
this probe (batch-1 bf16 matrix-vector products over a few hundred MiB of weights, the memory-bound shape of an
MoE decode step) for one second before calibration and before every bench run, and reads the CPU time the
hypervisor took meanwhile (steal, /proc/stat), so that a report says how far the machine itself moved.
"""

from __future__ import annotations

import time

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
