"""`weightstream tune`: what to run with this much memory, and how fast it will be.

Budget from the checkpoint, routing from a trace or a short recording, a short calibration of this machine (saved
next to the model), a search over policies and cache sizes and the page cache with the simulator, and the answer:
a table, the exact `weightstream generate` command, and the llama.cpp equivalent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from weightstream.errors import WeightstreamError
from weightstream.units import SIZE_HELP

EPILOG = """\
examples:
  weightstream tune models/olmoe --memory 5GiB                          # built-in prompts, calibrate once
  weightstream tune models/olmoe --memory 5GiB --prompts my.txt --json  # your prompts' routing
  weightstream tune models/olmoe --memory 5GiB --trace ds.npz --plot tune.png
  weightstream tune models/olmoe --memory 5GiB --calibrate              # measure again, median of the last 5
  weightstream tune models/olmoe --memory 5GiB --cost-model bench.json  # bench's linear fit instead
"""


def register(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="recommend the expert cache size and policy (or the page cache) for a memory limit, with predicted speed",
        description="Divides --memory into dense weights, KV cache, the runtime's overhead and an expert budget; "
        "takes routing from a trace or records it on prompts; calibrates this machine briefly (saved next to the "
        "model); replays the routing through every policy at every cache size that fits and through the page "
        "cache; predicts decode tok/s with a cost model that overlaps reads with compute; recommends.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument("--memory", required=True, metavar="SIZE", help=f"memory the run may use in all: {SIZE_HELP}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="TRACE", help="routing to judge by (.npz from `weightstream trace`)")
    src.add_argument("--prompts", metavar="FILE", help="record routing on these prompts (one per line, or .jsonl)")
    p.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="N", help="tokens per prompt when recording (default 16)"
    )
    cal = p.add_mutually_exclusive_group()
    cal.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine again and add it to the saved calibrations (tune prices with the median of the "
        "last 5 of this machine and setting: one calibration's minute of a noisy machine does not decide)",
    )
    cal.add_argument("--cost-model", metavar="FILE", help="the linear cost model of a `weightstream bench --json`")
    p.add_argument(
        "--forget-calibrations",
        action="store_true",
        help="with --calibrate: drop the earlier calibrations of this machine and setting, price with the new one "
        "alone (after a change the saved key cannot see: another disk behind the same device, a BIOS setting)",
    )
    p.add_argument("--context", type=int, default=4096, metavar="TOKENS", help="KV cache to budget for (default 4096)")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16", "q8_0"),
        help="DeepSeek-V2/V3, Kimi-K2 and kin: price the latent KV cache in this dtype, as `generate --kv-dtype` "
        "keeps it (float16: half the bytes of an import's float32; q8_0: 27%% of them), and say it in the command "
        "(default auto: the model's dtype)",
    )
    p.add_argument("--io-threads", type=int, default=4, metavar="N", help="the engine's I/O threads (default 4)")
    p.add_argument(
        "--policies",
        default="lru,slru,lfu,pinned,adaptive",
        help="policies to search (default all; belady is the bound)",
    )
    p.add_argument("--gpu-memory", metavar="SIZE", help="llama.cpp advice: GPU memory, for --n-cpu-moe")
    p.add_argument("--plot", metavar="OUT.png", help="also draw predicted tok/s against cache size per policy")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def _check_args(args) -> None:
    """Refuse bad arguments before any work (importing torch, loading the checkpoint, recording, calibrating); sets
    `args.memory_bytes`, `args.gpu_memory_bytes`, `args.policy_names` and `args.linear` (bench's cost model)."""
    from weightstream.units import parse_size

    if args.max_new_tokens < 2:
        raise WeightstreamError(f"--max-new-tokens {args.max_new_tokens}: need at least 2 (one decode step)")
    if args.forget_calibrations and not args.calibrate:
        raise WeightstreamError("--forget-calibrations: only with --calibrate (it replaces them with a new one)")
    if args.context < 1:
        raise WeightstreamError(f"--context {args.context}: need at least 1 token")
    if args.io_threads < 1:
        raise WeightstreamError(f"--io-threads {args.io_threads}: need at least 1 I/O thread (default 4)")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise WeightstreamError(f"--plot {args.plot}: its directory does not exist")
    args.memory_bytes = parse_size(args.memory, what="--memory")
    from weightstream.engine.footprint import check_memory

    check_memory(args.memory_bytes)  # a budget larger than the machine: refused, as generate refuses it
    args.gpu_memory_bytes = None
    if args.gpu_memory is not None:
        args.gpu_memory_bytes = parse_size(args.gpu_memory, what="--gpu-memory")
        if args.gpu_memory_bytes <= 0:
            raise WeightstreamError(
                f"--gpu-memory {args.gpu_memory}: need more than 0 bytes (leave it out for a CPU-only answer)"
            )
    args.policy_names = policy_names(args.policies)
    args.linear = None
    if args.cost_model:
        from weightstream.bench.calibration_store import read_cost_model

        args.linear = read_cost_model(args.cost_model)


def policy_names(text: str) -> list[str]:
    """The policies of `--policies` (comma-separated, each once, in order), or an error listing the valid ones."""
    from weightstream.cache.policies import POLICY_NAMES

    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise WeightstreamError(
            f"--policies: unknown {unknown}; choose from {', '.join(POLICY_NAMES)} (belady, the bound, is always "
            "searched)"
        )
    if not names:
        raise WeightstreamError(
            f"--policies {text!r}: no policy; choose from {', '.join(POLICY_NAMES)}, comma-separated"
        )
    return names


def run(args) -> int:
    _check_args(args)
    from weightstream.commands import tune_report
    from weightstream.tune.session import TuneSession

    started = time.perf_counter()
    session = TuneSession(args.model, args.memory_bytes, args.context, args.io_threads, args.kv_dtype)
    try:
        session.budget.check()
        trace, routing = session.routing(args.trace, args.prompts, args.max_new_tokens)
        cost = session.cost(args.calibrate, args.linear, args.cost_model, forget=args.forget_calibrations)
        report = session.answer(trace, routing, cost, args.policy_names, args.max_new_tokens, args.gpu_memory_bytes)
    finally:
        session.close()
    report["timings_s"]["total"] = time.perf_counter() - started
    if args.plot:
        tune_report.plot(report, args.plot)
    tune_report.emit(report, as_json=args.json)
    return 0
