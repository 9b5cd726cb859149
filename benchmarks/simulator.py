"""The simulator on the real routing traces: the figures and plots behind docs/cache-policies.md (LRU against
pinning, below 1x, where SLRU overtakes LRU, how far LRU is from Belady). Prints JSON, writes it to --json, draws
the PNGs into --out.

    .venv/bin/python benchmarks/simulator.py --trace deepseek=ds.npz --trace mixtral=mix.npz --out docs \\
        --json benchmarks/results/simulator-policies.json

One part runs by name instead:

    speed      lookups per CPU second of every policy on one core, against the reference path (the runtime's
               access_layer) and libCacheSim's C replay (parts/sim_speed.py):
               .venv/bin/python benchmarks/simulator.py speed --trace ds.npz

Traces are imported from ../shared/traces as docs/trace-format.md shows.

Every figure judges the second half of the requests after the first half chose the pinned set and warmed
every cache (`weightstream simulate --train-share 0.5`, the default), unless marked "flat".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import run_part
from common.results import default, save

from weightstream.sim import Workload
from weightstream.sim.plot import plot_results
from weightstream.sim.replay import Options, run_one
from weightstream.trace import load

MIB = 2**20
GRID = [round(0.5 + 0.25 * i, 2) for i in range(31)]  # 0.5x .. 8x, every policy, for the plots
FINE = [round(1.0 + 0.05 * i, 2) for i in range(61)]  # 1x .. 4x, LRU vs SLRU crossover
POLICIES = ("lru", "slru", "lfu", "pinned", "adaptive", "belady")


def sweep(w: Workload, policies, multiples) -> dict:
    """{policy: {multiple: Result}}."""
    ws = w.trace.shape.working_set_bytes
    return {p: {m: run_one(w, p, int(ws * m), Options()) for m in multiples} for p in policies}


def crossover(fine: dict) -> dict:
    """Where SLRU's hits first reach LRU's, and every multiple where LRU still wins above that."""
    lru, slru = fine["lru"], fine["slru"]
    first = next((m for m in FINE if slru[m].hits >= lru[m].hits), None)
    later_lru_wins = [m for m in FINE if first is not None and m > first and lru[m].hits > slru[m].hits]
    worst = min(FINE, key=lambda m: slru[m].hit_rate - lru[m].hit_rate)
    return {
        "slru_first_reaches_lru_at": first,
        "lru_wins_again_at": later_lru_wins,
        "largest_lru_lead": {
            "at": worst,
            "lru_hit_rate": round(lru[worst].hit_rate, 4),
            "slru_hit_rate": round(slru[worst].hit_rate, 4),
        },
    }


def rows(res: dict, multiples, policies) -> list[dict]:
    """Hit rate and MiB/token per policy at the given multiples."""
    return [
        {
            "x": m,
            **{
                p: {
                    "hit_rate": round(res[p][m].hit_rate, 4),
                    "mib_per_token": round(res[p][m].bytes_per_token / MIB, 1),
                }
                for p in policies
            },
        }
        for m in multiples
    ]


def flat_lru_hit_rate(w: Workload, multiple: float) -> float:
    """LRU when every lookup is served alone (no layer pinning), for comparison with the pinned replay."""
    from weightstream.sim import kernels

    flat = np.arange(len(w.keys) + 1, dtype=np.int64)
    dist = kernels.lru_distances(w.keys, flat, w.n_keys)[w.count_from :]
    return round(float((dist < int(w.trace.shape.working_set_slots * multiple)).mean()), 4)


def study(name: str, path: str, out: Path) -> dict:
    """All findings for one trace, plus its plot."""
    trace = load(path)
    w = Workload(trace, 0.5)
    grid, fine = sweep(w, POLICIES, GRID), sweep(w, ("lru", "slru"), FINE)
    plot_results(
        [r for p in POLICIES for r in grid[p].values()],
        trace.shape.working_set_bytes,
        out / f"cache-policies-{name}.png",
        title=f"{trace.shape.name}: requests {w.train_requests + 1}..{len(trace.requests)} judged "
        f"({w.judged_tokens} tokens)",
    )
    below = [m for m in GRID if m < 1.0]
    return {
        "trace": path,
        "requests": len(trace.requests),
        "judged_tokens": w.judged_tokens,
        "judged_accesses": len(w.keys) - w.count_from,
        "working_set_mib": trace.shape.working_set_bytes / MIB,
        "lru_vs_pinned": rows(grid, [0.5, 1.0, 2.0, 3.5, 4.0, 8.0], ("lru", "pinned")),
        "below_1x_best_lru_hit_rate": max(grid["lru"][m].hit_rate for m in below),
        "below_1x": rows(grid, below, ("lru", "slru", "lfu", "pinned", "belady")),
        "crossover": crossover(fine),
        "lru_slru_fine": [
            {"x": m, "lru": round(fine["lru"][m].hit_rate, 4), "slru": round(fine["slru"][m].hit_rate, 4)} for m in FINE
        ],
        "lru_vs_belady": [
            {
                "x": m,
                "lru_mib": round(grid["lru"][m].bytes_per_token / MIB, 1),
                "belady_mib": round(grid["belady"][m].bytes_per_token / MIB, 1),
                "lru_over_belady": round(grid["lru"][m].bytes_per_token / max(grid["belady"][m].bytes_per_token, 1), 2),
            }
            for m in [0.5, 1.0, 1.5, 2.0, 4.0, 8.0]
        ],
        "adaptive_vs_best_of_lru_slru": [
            {
                "x": m,
                "adaptive": round(grid["adaptive"][m].hit_rate, 4),
                "best": round(max(grid["lru"][m].hit_rate, grid["slru"][m].hit_rate), 4),
            }
            for m in [1.0, 1.5, 1.75, 2.0, 4.0]
        ],
        "flat_vs_pinned_lru_at_1x": {"flat": flat_lru_hit_rate(w, 1.0), "pinned": round(grid["lru"][1.0].hit_rate, 4)},
        "_fine": fine,
    }


def plot_crossover(results: dict, out: Path) -> None:
    """SLRU minus LRU hit rate against the multiple of one token's working set, one line per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=120)
    for name, r in results.items():
        fine = r["_fine"]
        ax.plot(FINE, [100 * (fine["slru"][m].hit_rate - fine["lru"][m].hit_rate) for m in FINE], label=name)
    ax.axhline(0, color="grey", linewidth=1)
    ax.axvline(1.8, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        "1.8x (adaptive's default switch)",
        (1.8, ax.get_ylim()[0]),
        xytext=(4, 6),
        textcoords="offset points",
        fontsize=8,
        color="grey",
    )
    ax.set_xlabel("cache size / one token's working set")
    ax.set_ylabel("SLRU hit rate - LRU hit rate (points)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cache-policies-crossover.png")
    plt.close(fig)


def main() -> None:
    if run_part("simulator.py", {"speed": "sim_speed"}):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", required=True, help="NAME=PATH of an imported trace (repeat)")
    ap.add_argument("--out", default="docs", help="directory for the PNGs (default docs)")
    ap.add_argument("--json", default=default("simulator-policies.json"), help="result file (default: %(default)s)")
    args = ap.parse_args()
    out = Path(args.out)
    results = {name: study(name, path, out) for name, path in (t.split("=", 1) for t in args.trace)}
    plot_crossover(results, out)
    text = json.dumps({k: {f: v for f, v in r.items() if not f.startswith("_")} for k, r in results.items()}, indent=1)
    print(text)
    save(text, args.json)


if __name__ == "__main__":
    main()
