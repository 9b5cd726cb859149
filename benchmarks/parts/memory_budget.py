"""`--memory`: the expert cache the engine sizes for itself inside a memory cgroup, against fixed caches, back to back.

Each round runs `weightstream bench MODEL --memory-limit SIZE --expert-cache 1x,...,memory` (its own cgroup of SIZE a
run, the model's files dropped from the page cache before each, a routing trace replayed so every configuration
reads what real routing reads); the configurations' order alternates between rounds. Per configuration: the cache
it ran with, decode tok/s, MiB read a token, the cgroup's peak and file refaults, whether the kernel killed it; per
round the ratio of `memory`'s tok/s to each fixed cache's. Needs root (cgroups), like `bench`.

    .venv/bin/python benchmarks/memory_bench.py budget .work/olmoe4/q4 --memory 1GiB --trace .work/ds.npz --rounds 5 \\
        [--caches 1x,2x] [--out benchmarks/results/memory-budget-olmoe4-1gib.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from common.bench_runs import MIB, bench_caches
from common.results import default, emit


def _mib(footprint: dict) -> dict:
    return {k: v if k.endswith("_tokens") else round(v / MIB, 1) for k, v in footprint.items()}


def bench_round(args, caches: list[str]) -> dict:
    out = bench_caches(args, caches)
    for figures in out.values():
        run = figures.pop("run")
        figures["peak_rss_mib"] = (run.get("peak_rss_bytes") or 0) / MIB
        figures["file_refaults"] = (run.get("cgroup_pressure") or {}).get("file_refaults")
        figures["footprint_mib"] = _mib(run["memory"]) if run.get("memory") else None
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--memory", default="1GiB", help="the cgroup limit and --memory (default 1GiB)")
    ap.add_argument("--caches", default="1x", help="fixed caches to compare with (default 1x)")
    ap.add_argument("--trace", help="routing trace to replay (e.g. the shared DeepSeek-V2-Lite one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=default("memory-budget.json"))
    args = ap.parse_args(argv)
    fixed = [c.strip() for c in args.caches.split(",") if c.strip()]
    rounds = []
    for r in range(args.rounds):
        caches = [*fixed, "memory"] if r % 2 == 0 else ["memory", *fixed]
        rounds.append(bench_round(args, caches))
        print(f"[memory-budget] round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    summary = {}
    for cache in [*fixed, "memory"]:
        tok = [x[cache]["decode_tokens_per_s"] for x in rounds if x[cache]["decode_tokens_per_s"]]
        summary[cache] = {
            "killed_or_failed": sum(1 for x in rounds if x[cache]["error"]),
            "expert_cache_mib": [round(x[cache]["expert_cache_mib"], 1) for x in rounds],
            "decode_tokens_per_s_median": statistics.median(tok) if tok else None,
            "decode_tokens_per_s": [round(t, 2) for t in tok],
            "mib_read_per_token_median": statistics.median(x[cache]["mib_read_per_token"] for x in rounds),
        }
    for cache in fixed:
        ratios = [
            x["memory"]["decode_tokens_per_s"] / x[cache]["decode_tokens_per_s"]
            for x in rounds
            if x["memory"]["decode_tokens_per_s"] and x[cache]["decode_tokens_per_s"]
        ]
        summary[f"memory_over_{cache}"] = {
            "per_round": [round(q, 3) for q in ratios],
            "median": statistics.median(ratios) if ratios else None,
        }
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "memory": args.memory,
        "trace": args.trace,
        "rounds": rounds,
        "summary": summary,
    }
    emit(report, args.out)
