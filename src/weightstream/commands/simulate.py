"""`weightstream simulate`: replay a routing trace through cache policies at several sizes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from weightstream.errors import WeightstreamError

MIB = 2**20

EPILOG = """\
Replay: one lookup per (token, routed layer, chosen expert), steps in order, layers ascending, experts as
listed; a layer's own experts are never evicted to serve each other; the cache persists across requests.

examples:
  weightstream simulate ds.npz                                     # every policy at 0.5x..8x
  weightstream simulate ds.npz --policies lru,slru --sizes 1x,1.5x,2GiB,4500MiB --plot ds.png
  weightstream simulate ds.npz --policies lru,slru --sizes 1x:4x:0.05x  # find where SLRU overtakes LRU
  weightstream simulate ds.npz --train-share 0 --json              # count every access (engine parity)
  weightstream simulate ds.npz --policies lru --sizes 1x,2x --miss-copy-ratio 0.58 --upgrade-after 1,2,never
                                                                   # what --miss-copy would read (not exact)
"""


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a routing trace through cache policies and sizes: hits, bytes read per token",
        description="Replay a routing trace (from `weightstream trace import/record`) through expert-cache policies "
        "at several cache sizes and report hits, misses and expert bytes read per token.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace file (.npz) written by `weightstream trace`")
    p.add_argument(
        "--policies",
        default="lru,slru,lfu,pinned,adaptive,belady",
        help="comma-separated: lru, slru, lfu, pinned, adaptive, belady (default: all)",
    )
    p.add_argument(
        "--sizes",
        default="0.5x,1x,1.5x,2x,4x,8x",
        help="comma-separated cache sizes: bytes with a unit (4500MiB, 2GiB) or multiples of one "
        "token's working set (1x = top-k experts in every routed layer), or START:STOP:STEP ranges "
        "such as 1x:4x:0.25x; default 0.5x,1x,1.5x,2x,4x,8x",
    )
    p.add_argument(
        "--train-share",
        type=float,
        default=0.5,
        help="first share of the requests that picks the pinned experts and warms every cache; all "
        "figures count only the remaining requests (default 0.5; 0 counts everything, pinned in-sample)",
    )
    p.add_argument("--protected-share", type=float, default=0.5, help="SLRU protected segment share (default 0.5)")
    p.add_argument(
        "--adaptive-threshold",
        type=float,
        default=1.8,
        help="adaptive: LRU below this multiple of the working set, SLRU at or above (default 1.8)",
    )
    p.add_argument(
        "--method",
        choices=("auto", "fast", "reference"),
        default="auto",
        help="fast: compiled replays; reference: the runtime's own policy objects (slow, identical)",
    )
    p.add_argument(
        "--miss-copy-ratio",
        metavar="R",
        help="also report what `generate --miss-copy` would read (tokens not exact): every miss reads a small copy of "
        "R x an expert's bytes into a full slot, every upgrade the full expert (R: 0.58 for Q2_K copies of Q4_K "
        "experts, `quantize --miss-bits 2`; 0.76 for Q3_K). Hits and misses are exact mode's",
    )
    p.add_argument(
        "--upgrade-after",
        metavar="N[,M...|never]",
        help="with --miss-copy-ratio: the upgrade settings to replay, comma-separated, as `generate --upgrade-after` "
        "takes one (the hit on a small copy that reads its full blob; never: small copies stay until evicted); "
        "default 1,2,4,8,never",
    )
    c = p.add_argument_group(
        "a cluster of expert shards (generate/serve --expert-shards; docs/serving.md)",
        "price the cluster instead of the policies: each of --shards holds the hottest experts of its share that "
        "fit in --shard-memory (heat from the first --train-share of the requests), the head caches the rest (LRU, "
        "--head-cache) and reads its misses; per judged token: round trips, bytes on the network and their time, "
        "the head's reads",
    )
    c.add_argument("--shards", type=int, metavar="N", help="shard processes (machines) holding experts")
    c.add_argument("--shard-memory", metavar="SIZE", help="what each shard may hold, its process included")
    c.add_argument(
        "--shard-base",
        default="512MiB",
        metavar="SIZE",
        help="what a shard's process holds before any expert (default 512MiB; 470-495 MiB measured for a 16-layer "
        "OLMoE, the plan of `generate --shard-plan` says it for a model)",
    )
    c.add_argument("--head-cache", default="1x", metavar="SIZE", help="the head's expert cache (default 1x)")
    c.add_argument("--hidden", type=int, metavar="N", help="the model's hidden size (the rows that travel)")
    c.add_argument("--network-gbps", type=float, default=25.0, metavar="G", help="bandwidth (default 25 Gb/s)")
    c.add_argument("--network-rtt-us", type=float, default=50.0, metavar="US", help="round trip (default 50 us)")
    c.add_argument("--shard-placement", choices=("layers", "spread"), default="layers", help="as --expert-shards")
    c.add_argument(
        "--shard-replicas",
        type=int,
        default=0,
        metavar="N",
        help="as generate's: the N hottest experts get a second copy, after each shard's own share (default 0)",
    )
    c.add_argument(
        "--shard-down",
        metavar="I[,J...]",
        help="price the cluster with these shards dead (numbered from 0): their experts served by live copies, "
        "else read by the head; e.g. --shards 3 --shard-replicas 300 --shard-down 0",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    p.add_argument("--plot", metavar="OUT.png", help="also draw MiB read per token against cache size")
    p.set_defaults(func=run)


def _policies(text: str) -> list[str]:
    from weightstream.sim import SIM_POLICIES

    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIM_POLICIES]
    if not names or unknown:
        raise WeightstreamError(f"--policies: unknown {unknown or 'empty list'}; choose from {', '.join(SIM_POLICIES)}")
    return list(dict.fromkeys(names))


def _miss_copy(args):
    """The MissCopy of --miss-copy-ratio / --upgrade-after, or None; refused before the trace is read."""
    from weightstream.sim.miss_copy import MissCopy, parse_ratio, parse_upgrade_after

    if args.miss_copy_ratio is None:
        if args.upgrade_after is not None:
            raise WeightstreamError(
                "--upgrade-after goes with --miss-copy-ratio (a small copy's bytes over its blob's, e.g. 0.58): "
                "without it every miss reads the full expert"
            )
        return None
    return MissCopy(parse_ratio(args.miss_copy_ratio), parse_upgrade_after(args.upgrade_after or "1,2,4,8,never"))


def _table(trace, results, w) -> None:
    from rich.console import Console
    from rich.table import Table

    ws = trace.shape.working_set_bytes
    table = Table(
        title=f"{trace.shape.name}: {w.judged_tokens} tokens judged (requests {w.train_requests + 1}.."
        f"{len(trace.requests)} of {len(trace.requests)}), working set {ws / MIB:.0f} MiB"
    )
    for col in ("policy", "cache MiB", "x WS", "slots", "hits", "misses", "hit rate", "MiB/token"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in sorted(results, key=lambda r: (r.cache_bytes, r.policy)):
        table.add_row(
            r.policy,
            f"{r.cache_bytes / MIB:.0f}",
            f"{r.cache_bytes / ws:.2f}",
            "-" if r.slots is None else str(r.slots),
            str(r.hits),
            str(r.misses),
            f"{r.hit_rate:.2%}",
            f"{r.bytes_per_token / MIB:.1f}",
        )
    console = Console()
    console.width = max(console.width, 100)  # keep every column readable in pipes and narrow terminals
    console.print(table)
    if results and results[0].miss_copy:
        console.print(_miss_copy_table(results, ws))


def _miss_copy_table(results, ws: int):
    from rich.table import Table

    from weightstream.sim.miss_copy import setting_name

    ratio = results[0].miss_copy[0].ratio
    table = Table(
        title=f"--miss-copy, small copies {ratio:g}x an expert (NOT exact: tokens differ from the model's): a miss "
        "reads a small copy, an upgrade the full expert"
    )
    cols = ("policy", "cache MiB", "x WS", "upgrade after", "small reads", "upgrades", "small hits", "MiB/token")
    for col in (*cols, "x exact"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in sorted(results, key=lambda r: (r.cache_bytes, r.policy)):
        for m in r.miss_copy:
            table.add_row(
                r.policy,
                f"{r.cache_bytes / MIB:.0f}",
                f"{r.cache_bytes / ws:.2f}",
                str(setting_name(m.upgrade_after)),
                str(m.small_reads),
                str(m.upgrades),
                str(m.small_hits),
                f"{m.bytes_per_token / MIB:.1f}",
                f"{m.bytes_read / r.bytes_read:.2f}" if r.bytes_read else "-",
            )
    return table


def _print_json(trace, results, w, miss_copy) -> None:
    out = {
        "tokens": w.judged_tokens,
        "accesses": trace.n_accesses - w.count_from,
        "working_set_bytes": trace.shape.working_set_bytes,
        "results": [r.to_json() for r in results],
    }
    if miss_copy is not None:
        out["miss_copy"] = {"ratio": miss_copy.ratio, "exact": False}
    json.dump(out, sys.stdout)
    print()


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from weightstream.sim import Options, Workload
    from weightstream.sim.plot import plot_results
    from weightstream.sim.replay import run_one
    from weightstream.sim.sizes import parse_sizes
    from weightstream.trace import load

    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise WeightstreamError(f"--plot {args.plot}: its directory does not exist; create it or choose another")
    miss_copy = _miss_copy(args)
    trace = load(args.trace)
    if not trace.n_steps:
        raise WeightstreamError(
            f"{args.trace}: the trace has no steps, so there is no routing to replay; import or record one with tokens"
        )
    if args.shards is not None or args.shard_memory is not None or args.shard_down or args.shard_replicas:
        return _cluster(args, trace)
    policies, sizes = _policies(args.policies), parse_sizes(args.sizes, trace.shape.working_set_bytes)
    w = Workload(trace, args.train_share)
    opts = Options(protected_share=args.protected_share, threshold=args.adaptive_threshold)
    results = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"replaying {trace.n_accesses:,} lookups", total=len(policies) * len(sizes))
        for name in policies:
            for size in sizes:
                results.append(run_one(w, name, size, opts, args.method, miss_copy))
                progress.advance(task)
    if args.plot:
        plot_results(
            results,
            trace.shape.working_set_bytes,
            args.plot,
            title=f"{trace.shape.name}, {w.judged_tokens} judged tokens",
        )
    if args.json:
        _print_json(trace, results, w, miss_copy)
    else:
        _table(trace, results, w)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _shard_list(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise WeightstreamError(
            f"--shard-down {text!r}: give shard numbers separated by commas, e.g. 0 or 0,2"
        ) from None


def _cluster(args, trace) -> int:
    """`--shards`: the cluster priced (sim/cluster.py), as a table or --json."""
    from weightstream.sim.cluster import ClusterSpec, price_cluster
    from weightstream.sim.sizes import parse_sizes
    from weightstream.units import parse_size

    if args.shards is None or args.shard_memory is None or args.hidden is None:
        raise WeightstreamError("--shards prices a cluster: give --shards N, --shard-memory SIZE and --hidden N")
    if args.hidden < 1 or not 0 < args.network_gbps < 1e6 or not 0 <= args.network_rtt_us < 1e9:  # nan, inf too
        raise WeightstreamError("--hidden and --network-gbps must be positive, --network-rtt-us 0 or more")
    spec = ClusterSpec(
        shards=args.shards,
        shard_memory=parse_size(args.shard_memory, "--shard-memory"),
        shard_base=parse_size(args.shard_base, "--shard-base"),
        head_cache=parse_sizes(args.head_cache, trace.shape.working_set_bytes)[0],
        hidden=args.hidden,
        gbps=args.network_gbps,
        rtt_us=args.network_rtt_us,
        placement=args.shard_placement,
        replicas=args.shard_replicas,
        down=_shard_list(args.shard_down),
    )
    report = price_cluster(trace, spec, args.train_share)
    if args.json:
        print(json.dumps({"trace": trace.shape.name, "cluster": report}))
        return 0
    on = report["experts_on_shards"]
    print(
        f"{trace.shape.name}: {report['judged_tokens']} judged tokens; {args.shards} shards of "
        f"{args.shard_memory} hold {on} of {report['experts']} experts ({report['experts_per_shard']} each)"
    )
    if report["replicas"] or report["down"]:
        down = ", ".join(map(str, report["down"])) or "none"
        print(f"  held twice                 {report['experts_held_twice']} experts; shards down: {down}")
    print(f"  lookups served by shards   {100 * report['share_of_lookups_on_shards']:.1f}%")
    print(
        f"  round trips a token        {report['round_trips_per_token']} "
        f"({report['layers_with_a_trip_per_token']} layers wait on one)"
    )
    print(
        f"  network a token            {report['network_bytes_per_token'] / 1024:.1f} KiB, "
        f"{report['network_ms_per_token']:.2f} ms at {args.network_gbps:g} Gb/s and {args.network_rtt_us:g} us"
    )
    print(
        f"  head reads a token         {report['head_mib_read_per_token']:.1f} MiB "
        f"({report['head_misses_per_token']} misses; its cache {report['head_cache_experts']} experts)"
    )
    return 0
