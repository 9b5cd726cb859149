"""`weightstream bench`: decode under a real memory limit, weightstream's expert cache against the page cache and
accelerate's disk offload, side by side in one run."""

from __future__ import annotations

import json
import sys

from weightstream.commands.common import add_expert_kernel_option, add_miss_copy_option, upgrade_after_of
from weightstream.units import SIZE_HELP


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="decode benchmark under a real memory limit: expert cache vs page cache vs accelerate",
        description="Runs every configuration in its own process inside a memory cgroup (the limit counts the "
        "page cache; no swap), after dropping the model's files from the page cache, and reads the block "
        "device's counters before and after. Modes: expert-cache (weightstream's own cache, O_DIRECT reads; "
        "'direct' is accepted too), page-cache (same engine, experts through mmap), accelerate (transformers + "
        "accelerate disk offload). Tokens are compared "
        "with transformers in memory when the machine can hold the model. Needs root (cgroups, drop_caches).",
        epilog="example: weightstream bench models/olmoe --memory-limit 5GiB --expert-cache 1x,2x "
        "--routing-trace traces/deepseek.npz --json",
    )
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument(
        "--memory-limit", required=True, metavar="SIZE", help=f"cgroup memory limit for each run: {SIZE_HELP}"
    )
    p.add_argument(
        "--expert-cache",
        default="1.5x",
        metavar="SIZE[,SIZE...]",
        help="expert cache size(s) for expert-cache runs: bytes (2GiB) or multiples of one token's working "
        "set (1.5x), or 'memory': the cache the engine sizes itself to --memory-limit (as `generate --memory`); "
        "several give the cost model its spread",
    )
    p.add_argument(
        "--modes",
        default="expert-cache,page-cache,accelerate",
        help="comma-separated subset of expert-cache,page-cache,accelerate (default all)",
    )
    p.add_argument(
        "--routing-trace",
        metavar="TRACE",
        help="replay this trace's routing instead of the router's "
        "(from `weightstream trace import`); labelled as replay, tokens not compared",
    )
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--io-threads", type=int, default=4, metavar="N")
    p.add_argument("--compute-threads", type=int, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--chunk-kib", type=int, metavar="KIB", help="O_DIRECT chunk size (default 1024)")
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=256,
        metavar="N",
        help="also time the prefill of an N-token prompt in expert-cache and page-cache runs (default 256; 0 skips it)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the in-memory transformers reference")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="skip the overlap check (the reader's bandwidth and "
        "a compute-only run with every expert resident, which needs the whole model in memory)",
    )
    p.add_argument(
        "--predict-next",
        action="store_true",
        help="expert-cache runs read ahead each next layer's guessed experts (see `weightstream generate --help`)",
    )
    add_miss_copy_option(p)  # expert-cache runs; labelled miss_copy_bits, tokens not compared as exact
    p.add_argument("--policy", default="lru", help="expert-cache runs' cache policy (default lru)")
    p.add_argument("--pinned-experts", metavar="FILE", help="--policy pinned: the experts to keep (from `tune`)")
    add_expert_kernel_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from weightstream.bench.prompts import long_prompt, tokenized_prompts
    from weightstream.bench.runner import BenchConfig, run_bench
    from weightstream.store.convert import runnable_dir
    from weightstream.units import parse_size

    config = BenchConfig(
        model_dir=runnable_dir(args.model),  # a published FP8 / MXFP4 checkpoint: the copy it runs through
        memory_limit=parse_size(args.memory_limit, what="--memory-limit"),
        expert_caches=[s.strip() for s in args.expert_cache.split(",") if s.strip()],
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        prompts=tokenized_prompts(args.model, args.prompts),
        max_new_tokens=args.max_new_tokens,
        routing_trace=args.routing_trace,
        io_threads=args.io_threads,
        compute_threads=args.compute_threads,
        chunk_bytes=args.chunk_kib * 1024 if args.chunk_kib else None,
        reference=not args.no_reference,
        predict_next=args.predict_next,
        miss_copy=args.miss_copy,
        upgrade_after=upgrade_after_of(args),
        expert_kernel=args.expert_kernel,
        overlap=not args.no_overlap,
        policy=args.policy,
        pinned_experts=args.pinned_experts,
        long_prompt=long_prompt(args.model, args.prefill_tokens) if args.prefill_tokens > 0 else None,
    )
    say = lambda m: print(f"[bench] {m} ...", file=sys.stderr, flush=True)  # noqa: E731  (stderr: JSON stays clean)
    report = run_bench(config, progress=say)
    if args.json:
        print(json.dumps(strip_tokens(report)))
    else:
        print_table(report)
    return 0


def strip_tokens(report: dict) -> dict:
    return {**report, "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in report["runs"]]}


def print_table(report: dict) -> None:
    mib = 2**20
    print(
        f"model {report['model']} ({report['model_bytes'] / 2**30:.1f} GiB), memory limit "
        f"{report['memory_limit_bytes'] / 2**30:.2f} GiB, routing: {report['routing']}, "
        f"reference: {report['reference']}"
    )
    print(
        f"{'mode':<13}{'cache':>7}{'tok/s':>8}{'prefill s':>10}{'long prefill s':>15}{'dev MiB/tok':>12}"
        f"{'hit rate':>9}{'peak RSS MiB':>13}{'tokens ok':>10}"
    )
    for r in report["runs"]:
        if "error" in r:
            print(f"{r['mode']:<13}  not run: {r['error']}")
            continue
        hit = f"{r['expert_hit_rate']:.1%}" if r.get("expert_hit_rate") is not None else "-"
        per = r["bytes_read_per_token"] / mib if r["bytes_read_per_token"] is not None else float("nan")
        long = f"{r['long_prefill']['prefill_s']:.2f} ({r['long_prefill']['tokens']})" if r.get("long_prefill") else "-"
        print(
            f"{r['mode']:<13}{r['expert_cache'] or '-':>7}{r['decode_tokens_per_s']:>8.2f}{r['prefill_s']:>10.2f}"
            f"{long:>15}{per:>12.1f}{hit:>9}{r['peak_rss_bytes'] / mib:>13.0f}"
            f"{str(r['token_ids_equal_to_reference']):>10}"
        )
    print_overlap(report.get("overlap"))
    cm = report["cost_model"]
    if "error" in cm:
        print(f"cost model: {cm['error']}")
    else:
        print(
            f"cost model: {cm['fixed_s'] * 1000:.1f} ms fixed + {cm['per_mib_s'] * 1000:.3f} ms per MiB read "
            f"(R^2 {cm['r2']:.3f}, {cm['points']} points)"
        )
        if "warning" in cm:
            print(f"cost model: {cm['warning']}")


def print_overlap(overlap: dict | None) -> None:
    if not overlap:
        return
    bw = overlap["reader_bandwidth"]
    print(f"reader O_DIRECT bandwidth: {bw['mib_per_s']:.0f} MiB/s ({bw['io_threads']} threads)")
    if "error" in overlap:
        print(f"overlap: not measured: {overlap['error']}")
        return
    print(f"compute-only (every expert resident): {overlap['compute_only_s_per_token'] * 1000:.1f} ms/token")
    for r in overlap["runs"]:
        print(
            f"overlap {r['expert_cache']}: {r['time_per_token_s'] * 1000:.1f} ms/token against max(compute "
            f"{r['compute_only_s'] * 1000:.1f}, reads {r['read_s'] * 1000:.1f}) = {r['ratio']:.2f}x "
            f"({'within' if r['within_target'] else 'outside'} {overlap['target_ratio']}x)"
        )
