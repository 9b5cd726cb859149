"""Decode under a memory limit, and the engine settings chosen from it: sweeps over `weightstream bench`.

The headline comparison (expert cache against the page cache and accelerate at one limit) is `weightstream bench`
itself (docs/benchmarks.md). These sweep around it, each point a full bench run (own cgroup, cold cache):

    pipeline   one pipeline setting varied at a time (I/O threads, compute threads, chunk size): the defaults
    limits     expert cache against page cache at several memory limits (--plot draws tok/s against the limit)

    .venv/bin/python benchmarks/engine_bench.py pipeline MODEL_DIR --memory-limit 5GiB --expert-cache 1x
    .venv/bin/python benchmarks/engine_bench.py limits MODEL_DIR --limits 3GiB,4GiB,5GiB,6GiB --plot limits.png

Beside them, `engine_bench.py predict-next` (next-layer prediction on against off, parts/predict_next.py) and
`engine_bench.py plot` (decode tok/s against expert-cache size from `weightstream bench --json` reports,
parts/plot_bench.py). Each prints one JSON object and writes it to --out (plot writes a PNG).
"""

from __future__ import annotations

import argparse
import sys

from common.results import default, emit

from weightstream.bench.prompts import tokenized_prompts
from weightstream.bench.runner import BenchConfig, run_bench
from weightstream.units import parse_size

KEEP = (
    "mode",
    "expert_cache",
    "decode_tokens_per_s",
    "prefill_s",
    "bytes_read_per_token",
    "expert_hit_rate",
    "io_wait_s",
    "peak_rss_bytes",
    "error",
)


def point(args, **overrides) -> dict:
    config = BenchConfig(
        model_dir=args.model,
        memory_limit=parse_size(args.memory_limit),
        prompts=args.prompt_ids,
        expert_caches=[args.expert_cache],
        modes=["expert-cache"],
        max_new_tokens=args.tokens,
        routing_trace=args.routing_trace,
        reference=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    report = run_bench(config, progress=lambda m: print(f"[sweep] {m}", file=sys.stderr, flush=True))
    return {"runs": [{k: r.get(k) for k in KEEP if k in r} for r in report["runs"]], **overrides}


def pipeline(args) -> list[dict]:
    """One setting varied at a time from the defaults; repeats interleaved so drift hits every setting alike."""
    settings = [{"io_threads": n} for n in (1, 2, 4, 8)] + [{"compute_threads": n} for n in (1, 2)]
    settings += [{"chunk_bytes": kib * 1024} for kib in (128, 512, 1024, 4096)]
    return [point(args, **s) | {"repeat": r} for r in range(args.repeats) for s in settings]


def limits(args) -> list[dict]:
    out = []
    for limit in args.limits.split(","):
        budget = parse_size(limit) - parse_size(args.reserve)
        out.append(
            point(
                args, memory_limit=parse_size(limit), expert_caches=[str(budget)], modes=["expert-cache", "page-cache"]
            )
            | {"limit": limit, "expert_cache_bytes": budget}
        )
    return out


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("expert-cache", "o-"), ("page-cache", "s--")):
        xs = [parse_size(p["limit"]) / 2**30 for p in points]
        ys = [
            next((r["decode_tokens_per_s"] for r in p["runs"] if r["mode"] == mode and "error" not in r), None)
            for p in points
        ]
        ax.plot([x for x, y in zip(xs, ys) if y], [y for y in ys if y], style, label=mode)
    ax.set_xlabel("memory limit of the run (GiB; direct: expert cache = limit - reserve)")
    ax.set_ylabel("decode tokens / s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", choices=("pipeline", "limits"), help="pipeline or limits (above)")
    ap.add_argument("model")
    ap.add_argument("--memory-limit", default="5GiB")
    ap.add_argument("--expert-cache", default="1x")
    ap.add_argument("--limits", default="3GiB,4GiB,5GiB,6GiB")
    ap.add_argument("--reserve", default="2GiB", help="memory kept for dense weights and the runtime (limits sweep)")
    ap.add_argument("--routing-trace")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", help="one prompt per line (default: the bench's built-in prompts)")
    ap.add_argument("--repeats", type=int, default=1, help="pipeline sweep: run every setting this many times")
    ap.add_argument("--plot")
    ap.add_argument(
        "--out",
        help="result file (default: benchmarks/results/engine-pipeline-sweep.json, or decode-limit-sweep.json)",
    )
    args = ap.parse_args(argv)
    out = args.out or default("engine-pipeline-sweep.json" if args.sweep == "pipeline" else "decode-limit-sweep.json")
    args.prompt_ids = tokenized_prompts(args.model, args.prompts)
    points = pipeline(args) if args.sweep == "pipeline" else limits(args)
    if args.plot:
        plot(points, args.plot)
    emit({"sweep": args.sweep, "model": args.model, "routing_trace": args.routing_trace, "points": points}, out)
