"""Prefetch settings side by side on one loader: each variant a cold run, interleaved over rounds, with ample
memory or inside a memory cgroup limited to the loader's peak anonymous memory + 45% of the checkpoint (as in
prefetch_bench.py). For trying budgets and reclaim gaps; prefetch_bench.py is the benchmark of record.

    PYTHONPATH=src .venv/bin/python benchmarks/prefetch_variants.py --loader safetensors --gib 8 --cap --reps 2 \\
        --variant plain= --variant gap1g=--reclaim-gap,1GiB \
        --variant burn-only=--memory-budget,2MiB,--reclaim-gap,256MiB

A variant is NAME=ARGS (comma-separated `prefetch run` options); an empty ARGS after `plain` means no prefetch.
A variant whose name ends in `-text` runs with WEIGHTSTREAM_TRACE_TEXT=1 (the kernel's text trace instead of
the binary ring-buffer pages).
Prints JSON: per variant the wall seconds, the process tree's CPU seconds, the loader's own load and CPU seconds,
and the prefetch report's byte counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefetch_checkpoint import build  # noqa: E402

from prefetch_bench import GIB, LIMIT_SHARE, LoaderBench, bench_env  # noqa: E402
from prefetch_measure import loader_argv, timed  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", default="safetensors")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--cap", action="store_true", help="run inside the 45%% memory cgroup (else ample memory)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--work", type=Path, default=Path(".work/bench-prefetch"))
    args = p.parse_args()
    variants = {}
    for v in args.variant or ["plain=", "prefetch=--reclaim-gap,1GiB"]:
        name, _, opts = v.partition("=")
        variants[name] = None if name == "plain" else tuple(o for o in opts.split(",") if o)
    work = args.work.resolve()
    model = work / f"moe-{args.gib:g}g"
    build(model, int(args.gib * GIB))
    lb = LoaderBench(args.loader, model, bench_env(work / "home"), args.reps, work)
    cold = lb.cold

    def cold_with_env(kind, prefetch, cgroup=None, extra=()):
        lb.env["WEIGHTSTREAM_TRACE_TEXT"] = "1" if kind.endswith("-text") else "0"
        return cold(kind, prefetch, cgroup, extra)

    lb.cold = cold_with_env
    lb.cold("warm-up", False)
    rec = lb.record()
    timed(loader_argv(lb.loader, lb.model), lb.env)  # warm, then a warm run measures the loader's own memory
    warm = timed(loader_argv(lb.loader, lb.model), lb.env)
    limit = int(warm.loader.get("peak_anon", 0) + LIMIT_SHARE * lb.bytes) if args.cap else None
    out = lb.rounds("limited" if args.cap else "ample", variants, limit)
    keep = (
        "bytes_prefetched",
        "bytes_used",
        "bytes_reclaimed",
        "bytes_reread_after_reclaim",
        "bytes_loader_missed",
        "bytes_evicted_before_use",
        "memory_budget",
        "events",
    )
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loader": args.loader,
        "bytes": lb.bytes,
        "cgroup_limit": limit,
        "warm_s": warm.wall_s,
        "record": {k: rec[k] for k in ("wall_s", "template_bytes")},
        "variants": {
            name: [
                {
                    "wall_s": round(o.wall_s, 2),
                    "tree_cpu_s": round(o.cpu_s, 2),
                    "loader_load_s": o.loader.get("load_s"),
                    "loader_cpu_s": o.loader.get("cpu_s"),
                    "prefetch": {k: o.report.get(k) for k in keep} if o.report else None,
                }
                for o in outs
            ]
            for name, outs in out.items()
        },
    }
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
