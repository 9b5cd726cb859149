"""Options and output shared by several subcommands (the engine's settings, the one-line run summary)."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING

from weightstream.cache.sizes import CACHE_SIZE_HELP, DEFAULT_UPGRADE_AFTER
from weightstream.engine import EXPERT_SOURCES, SOURCE_ALIASES
from weightstream.engine.footprint import MEMORY_PREFILL_CHUNK
from weightstream.errors import WeightstreamError
from weightstream.units import format_bytes

if TYPE_CHECKING:
    from weightstream.engine.config import EngineConfig

KERNEL_CHOICES = ("auto", "eager-linear", "eager-matmul-bias", "one-expert-eager")


def add_engine_options(p) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--expert-cache",
        metavar="SIZE",
        help=f"expert cache budget: {CACHE_SIZE_HELP}; below 1x is refused (default 1.5x, or what --memory leaves)",
    )
    size.add_argument(
        "--memory",
        metavar="SIZE",
        help="the memory the whole process may use (what a memory cgroup of SIZE would charge it): the engine "
        "measures its own footprint after load and a warm-up step, keeps room for the KV cache, and gives the "
        "expert cache the rest; a SIZE too small for one token's experts is refused with the size that would do. "
        "e.g. 1GiB, 6GB",
    )
    p.add_argument(
        "--warm-restart",
        action="store_true",
        help="save which experts the cache holds (and how hot) under MODEL/.weightstream at exit and every minute, "
        "and read them back at start, hottest first, in the background: the next run starts warm",
    )
    p.add_argument("--io-threads", type=int, default=4, metavar="N", help="dedicated I/O threads (default 4)")
    p.add_argument(
        "--policy",
        default="lru",
        help="cache policy: lru (default), slru, lfu, adaptive, pinned (needs --pinned-experts)",
    )
    p.add_argument(
        "--pinned-experts",
        metavar="FILE",
        help='--policy pinned: the experts to keep, {"pinned_experts": [[layer, expert], ...]} (`weightstream tune` '
        "writes one for its recommendation)",
    )
    p.add_argument(
        "--no-o-direct",
        "--no-direct",
        dest="no_o_direct",
        action="store_true",
        help="buffered reads into the expert cache instead of O_DIRECT (for comparison)",
    )
    p.add_argument(
        "--expert-source",
        default="expert-cache",
        type=_expert_source,
        metavar="{expert-cache,page-cache}",
        help="expert-cache: weightstream's own cache, read with O_DIRECT (default); page-cache: experts "
        "through mmap and the kernel's page cache, no cache of our own (what llama.cpp and "
        "safetensors users get). The old names direct and mmap are accepted",
    )
    p.add_argument(
        "--predict-next",
        action="store_true",
        help="at each MoE layer, guess the next layer's experts (this layer's input times the next "
        "router's weights) and read them early at low priority; tokens are unchanged, stats add "
        "readahead_issued, readahead_used and prediction_accuracy. Off by default: measured here it "
        "read more and decoded slower (docs/benchmarks.md, next-layer prediction)",
    )
    add_miss_copy_option(p)
    add_expert_kernel_option(p)
    p.add_argument(
        "--latent-attention",
        default="absorbed",
        choices=("absorbed", "expanded"),
        help="DeepSeek-V2/V3, Kimi-K2 and kin: absorbed (default) attends over the cached latent, so a token's cost "
        "grows little with the context (decode at 4096 positions measured in docs/benchmarks.md); logits within "
        "float32 rounding of transformers'. expanded: transformers' own form (re-expands every cached position a "
        "token), bitwise its logits. Other models have no latent attention and ignore it",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16", "q8_0"),
        help="the dtype DeepSeek's latent KV cache is kept in: auto (default: the model's, float32 for an imported "
        "GGUF; tokens exact), float16 / bfloat16: half the bytes a token (so --memory holds twice the context) "
        "and, at long contexts, faster decode, or q8_0 (llama.cpp's -ctk q8_0: 34 bytes a 32 values, 27%% of "
        "float32's); each cached value rounded once (the errors in docs/benchmarks.md, 'DeepSeek at any context'; "
        "llama.cpp keeps f16 by default). Models without latent attention refuse any but auto",
    )


def add_miss_copy_option(p) -> None:
    p.add_argument(
        "--miss-copy",
        action="store_true",
        help="fewer bytes a miss, tokens no longer exact (opt-in): on a cache miss read the expert's small copy (Q2_K "
        "or Q3_K, written by `quantize --miss-bits`) and compute with it; when the expert is looked up again while "
        "that copy is in the cache often enough (--upgrade-after: 8 hits, by default), it is hot: its full blob is "
        "read into the slot before it computes, and it stays full until evicted. Slots keep the full blob's size. "
        "Stats say miss_copy_bits, small reads and upgrades (docs/quantization.md, 'Small copies for misses')",
    )
    p.add_argument(
        "--upgrade-after",
        metavar="{N,never}",
        help=f"--miss-copy: the hit on an expert's small copy that reads its full blob (default "
        f"{DEFAULT_UPGRADE_AFTER}: replayed on real routing, 1 read nearly as much as exact mode, 8 nearly as little "
        "as never); until then its hits compute with the small copy and read nothing. 1: the first time it comes "
        "back. never: small copies stay until evicted (the fewest bytes, the most error)",
    )


def upgrade_after_of(args) -> int | None:
    """--upgrade-after as `load_streaming_model` takes it (DEFAULT_UPGRADE_AFTER when not given, None for never);
    refused without --miss-copy."""
    text = args.upgrade_after
    if text is None:
        return DEFAULT_UPGRADE_AFTER
    if not args.miss_copy:
        raise WeightstreamError("--upgrade-after goes with --miss-copy: without it every expert is read in full")
    if text == "never":
        return None
    if not text.isdigit() or int(text) < 1:
        raise WeightstreamError(f"--upgrade-after {text}: give a number of hits (1 or more) or never")
    return int(text)


def add_prefill_chunk_option(p) -> None:
    p.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="TOKENS",
        help="prefill a prompt TOKENS positions per forward, so no forward holds more than TOKENS positions' "
        "activations and temporaries whatever the prompt's length (default: the prompt in one forward; under "
        f"--memory {MEMORY_PREFILL_CHUNK}, the warm-up's prompt, so what it measured bounds every forward). generate "
        "and serve give the same tokens under the same chunk",
    )


def prefill_chunk_of(args) -> int | None:
    """--prefill-chunk as given (checked), else MEMORY_PREFILL_CHUNK under --memory, else None (one forward)."""
    chunk = args.prefill_chunk
    if chunk is not None and chunk < 1:
        raise WeightstreamError(f"--prefill-chunk {chunk}: must be at least 1 token")
    if chunk is None and args.memory is not None:
        return MEMORY_PREFILL_CHUNK
    return chunk


def miss_copy_note(command: str) -> str:
    """What `--miss-copy` changes, said once on stderr by the commands that take it."""
    return (
        f"weightstream {command}: --miss-copy: experts read on a miss compute with their small copies until they come "
        "back, so tokens are not the model's exact ones (leave --miss-copy out for those)"
    )


def add_expert_kernel_option(p) -> None:
    p.add_argument(
        "--expert-kernel",
        default="auto",
        choices=KERNEL_CHOICES,
        help="how each expert is computed: auto (default) takes the lean kernel proven, at load, bitwise equal to "
        "the architecture's eager forward, else one-expert-eager (that forward itself on a one-expert view, "
        "slower); naming one forces it, for comparisons",
    )


def engine_config(args, **more) -> EngineConfig:
    """The EngineConfig of the options `add_engine_options` defines (and `more` fields), checked before anything
    loads or binds: a --memory larger than this machine too (the loader checks it again where it runs)."""
    from weightstream.engine.config import EngineConfig  # torch and transformers: not for `--help`
    from weightstream.engine.footprint import check_memory

    config = EngineConfig(
        expert_cache=args.expert_cache,
        io_threads=args.io_threads,
        policy=args.policy,
        policy_options=_policy_options(args.policy, args.pinned_experts),
        o_direct=not args.no_o_direct,
        expert_source=args.expert_source,
        predict_next=args.predict_next,
        expert_kernel=args.expert_kernel,
        memory=args.memory,
        warm_restart=args.warm_restart,
        miss_copy=args.miss_copy,
        upgrade_after=upgrade_after_of(args),
        latent_attention=args.latent_attention,
        kv_dtype=args.kv_dtype,
        **more,
    )
    if config.memory_bytes is not None:
        check_memory(config.memory_bytes)
    return config


def _policy_options(policy: str, pinned_experts: str | None) -> dict | None:
    from weightstream.engine.loader import read_pinned_experts

    if pinned_experts and policy != "pinned":
        raise WeightstreamError(f"--pinned-experts goes with --policy pinned, not --policy {policy}")
    if policy == "pinned" and not pinned_experts:
        raise WeightstreamError(
            "--policy pinned needs --pinned-experts FILE (the experts to keep; `weightstream tune` writes one)"
        )
    return {"pinned_keys": read_pinned_experts(pinned_experts)} if pinned_experts else None


def _expert_source(text: str) -> str:
    name = SOURCE_ALIASES.get(text, text)
    if name not in EXPERT_SOURCES:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(EXPERT_SOURCES)}")
    return name


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise WeightstreamError(f"--prompt-ids {text!r}: not comma-separated integers, e.g. 1,2,3") from exc
    if not ids or min(ids) < 0:
        raise WeightstreamError(f"--prompt-ids {text!r}: need at least one non-negative token id")
    return ids


def summary_line(stats) -> str:
    """The run in one line; sizes in units that scale down, so a small model's cache is not "0 MiB"."""
    return (
        f"prefill {stats.prefill_s:.2f} s, decode {stats.decode_tokens_per_s:.2f} tok/s, "
        f"hit rate {stats.expert_hit_rate:.1%}, read {format_bytes(stats.bytes_read)} "
        f"({format_bytes(stats.bytes_read_per_token)}/token), I/O wait {stats.io_wait_s:.2f} s, "
        f"cache {format_bytes(stats.expert_cache_bytes)} ({stats.expert_cache_slots} slots; working set "
        f"{format_bytes(stats.working_set_bytes)})"
        + (prediction_line(stats) if stats.predict_next else "")
        + (miss_copy_line(stats) if stats.miss_copy_bits else "")
    )


def miss_copy_line(stats) -> str:
    mib = 2**20
    return (
        f"; miss copies (Q{stats.miss_copy_bits}_K): {stats.miss_copy_reads} small reads "
        f"({stats.miss_copy_bytes_read / mib:.1f} MiB), {stats.upgrades} upgraded to full "
        f"({stats.upgrade_bytes_read / mib:.1f} MiB)"
        + (f", {stats.miss_copy_hits} hits computed small" if stats.miss_copy_hits else "")
    )


def prediction_line(stats) -> str:
    return (
        f"; next-layer prediction {stats.prediction_accuracy:.1%} accurate, {stats.readahead_issued} read ahead, "
        f"{stats.readahead_used} used"
    )


MIN_SHARD_MEMORY = 2**30  # a shard's process holds 470-495 MiB before any expert (docs/serving.md)


def add_shard_options(p, ray_address: bool = True) -> None:
    """--expert-shards and its companions (generate, serve): experts held by shard processes (engine/shard_ray.py)."""
    g = p.add_argument_group(
        "expert shards (pip install 'weightstream[ray]'; docs/serving.md, 'Experts on shards')",
        "the experts held in the memory of N shard processes (Ray actors, one per machine on a real cluster), each "
        "layer's rows sent to the shards that own the chosen experts; the tokens are those of one process. Experts "
        "no shard has room for are read from disk by this process. Native GGML-block experts only (`weightstream "
        "quantize` or `import`)",
    )
    g.add_argument(
        "--expert-shards", type=int, default=0, metavar="N", help="shard processes (default 0: every expert here)"
    )
    g.add_argument(
        "--shard-memory",
        metavar="SIZE",
        help="what each shard may hold, its process included (e.g. 6GiB): it keeps the hottest experts of its share "
        "that fit beside what its process holds and, where it may (root, a cgroup memory controller), runs in a "
        "memory cgroup of SIZE of its own (default: no limit, every expert held)",
    )
    g.add_argument(
        "--shard-heat",
        metavar="TRACE.npz",
        help="the experts' heat: their lookups in this routing trace (`weightstream trace record` or `trace "
        "import`): each shard keeps the hottest of its share first, and --shard-placement spread balances each "
        "layer's heat over the shards (default: every expert alike)",
    )
    g.add_argument("--shard-plan", metavar="FILE.json", help="save the placement as built: shard -> experts, pids")
    g.add_argument(
        "--shard-transport",
        choices=("graph", "calls"),
        help="graph (default): a Ray compiled graph per shard (shared-memory channels); calls: plain actor calls",
    )
    g.add_argument(
        "--shard-placement",
        choices=("layers", "spread"),
        help="layers (default): consecutive layers to each shard, one round trip a layer (shards sharing a machine's "
        "cores, or a slow network); spread: each layer's experts over every shard, balanced by heat, the layer's "
        "compute in parallel (a shard per machine, a fast network)",
    )
    g.add_argument(
        "--shard-replicas",
        type=int,
        metavar="N",
        help="a second copy of the N hottest experts (by --shard-heat; without it the first layers' experts), each on "
        "the shard holding the least heat of its layer, kept in the room its own share leaves: while a shard is down "
        "its copied experts are computed by the other shard instead of read from disk by the head (default 0; needs "
        "2 or more shards)",
    )
    g.add_argument(
        "--shard-delay-us",
        type=float,
        metavar="US",
        help="benchmarks: add US microseconds to each layer's round trip to the shards (a network's latency)",
    )
    if ray_address:
        g.add_argument(
            "--ray-address",
            metavar="ADDR",
            help="with --expert-shards: the Ray cluster to place the shards on (default: a local one started here)",
        )


def ray_for_shards(options):
    """Ray running for the block where shards are asked for (engine/shard_ray.py's `ray_running`), else nothing. Enter
    it in the main thread, before the model loads: the processes Ray starts end with the thread that started it, and
    --memory then counts what Ray takes of this process."""
    if options is None:
        return contextlib.nullcontext()
    from weightstream.engine.shard_ray import ray_running

    return ray_running(options)


def shard_options(args):
    """ShardOptions of `add_shard_options`'s flags, checked before anything loads; None without --expert-shards."""
    from weightstream.units import parse_size

    n = args.expert_shards
    shard_flags = (
        "shard_memory",
        "shard_heat",
        "shard_plan",
        "shard_transport",
        "shard_placement",
        "shard_delay_us",
        "shard_replicas",
    )
    given = [f for f in shard_flags if getattr(args, f) is not None]
    delay = args.shard_delay_us if args.shard_delay_us is not None else 0.0
    if n < 0:
        raise WeightstreamError(f"--expert-shards {n}: give 1 or more shards (0: none)")
    if not 0 <= delay < 1e7:  # nan and inf too
        raise WeightstreamError(f"--shard-delay-us {delay}: give 0 or more microseconds (below 10 s)")
    if not n:
        if given:
            raise WeightstreamError(f"--{given[0].replace('_', '-')} places expert shards: give --expert-shards N")
        return None
    from weightstream.sim.placement import check_replicas

    replicas = args.shard_replicas or 0
    check_replicas(replicas, n)
    if args.shard_heat is not None and not os.path.isfile(args.shard_heat):
        raise WeightstreamError(f"--shard-heat {args.shard_heat}: no such file; give a routing trace (.npz)")
    if args.shard_plan is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.shard_plan))):
        raise WeightstreamError(f"--shard-plan {args.shard_plan}: its directory does not exist")
    if args.shard_plan is not None and os.path.isdir(args.shard_plan):
        raise WeightstreamError(f"--shard-plan {args.shard_plan}: is a directory; give a file name")
    from weightstream.engine.shard_ray import ShardOptions

    memory = parse_size(args.shard_memory, "--shard-memory") if args.shard_memory is not None else None
    if memory is not None and memory < MIN_SHARD_MEMORY:
        raise WeightstreamError(
            f"--shard-memory {args.shard_memory}: a shard's process alone holds about 500 MiB (Python, torch, Ray, "
            "the model's skeleton) before any expert; give at least 1GiB"
        )
    return ShardOptions(
        shards=n,
        memory=memory,
        heat_trace=args.shard_heat,
        plan_out=args.shard_plan,
        address=getattr(args, "ray_address", None),
        transport=args.shard_transport or "graph",
        placement=args.shard_placement or "layers",
        io_threads=args.io_threads,
        delay_us=delay,
        replicas=replicas,
    )
