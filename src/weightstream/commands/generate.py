"""`weightstream generate`: greedy generation with experts streamed from disk through a fixed-budget cache."""

from __future__ import annotations

import argparse
import json
import sys

from weightstream.engine import EXPERT_SOURCES, SOURCE_ALIASES
from weightstream.errors import WeightstreamError


def add_engine_options(p) -> None:
    p.add_argument(
        "--expert-cache",
        default="1.5x",
        metavar="SIZE",
        help="expert cache budget: bytes (512MiB, 2GiB) or a multiple of one token's working set "
        "(1.5x); below 1x is refused (default 1.5x)",
    )
    p.add_argument("--io-threads", type=int, default=4, metavar="N", help="dedicated I/O threads (default 4)")
    p.add_argument("--policy", default="lru", help="cache policy (default lru)")
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


def _expert_source(text: str) -> str:
    name = SOURCE_ALIASES.get(text, text)
    if name not in EXPERT_SOURCES:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(EXPERT_SOURCES)}")
    return name


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text, streaming experts from the checkpoint",
        description="Load a Mixture-of-Experts checkpoint with only its dense weights in memory and stream "
        "experts from disk through a fixed-budget expert cache (O_DIRECT, dedicated I/O threads, reads "
        "overlapped with compute). Tokens equal the in-memory model's. Greedy by default.",
        epilog="examples:\n  weightstream generate models/olmoe --prompt 'Hello' --expert-cache 2GiB\n"
        "  weightstream generate models/olmoe --prompt-ids 1,2,3 --max-new-tokens 16 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="model directory (config.json + *.safetensors), or a Hugging Face model id when the network allows",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    add_engine_options(p)
    p.add_argument(
        "--json", action="store_true", help='print one JSON object: {"token_ids": [...], "text": ..., "stats": {...}}'
    )
    p.set_defaults(func=run)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise WeightstreamError(f"--prompt-ids {text!r}: not comma-separated integers, e.g. 1,2,3") from exc
    if not ids or min(ids) < 0:
        raise WeightstreamError(f"--prompt-ids {text!r}: need at least one non-negative token id")
    return ids


def run(args) -> int:
    import torch

    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model, load_tokenizer, resolve_model

    if args.max_new_tokens < 1:
        raise WeightstreamError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir, required=args.prompt is not None)
    ids = tokenizer(args.prompt).input_ids if args.prompt is not None else parse_prompt_ids(args.prompt_ids)
    model = load_streaming_model(
        model_dir,
        args.expert_cache,
        args.io_threads,
        args.policy,
        o_direct=not args.no_o_direct,
        expert_source=args.expert_source,
        predict_next=args.predict_next,
    )
    vocab = model.config.get_text_config().vocab_size
    if max(ids) >= vocab:
        raise WeightstreamError(f"--prompt-ids: token id {max(ids)} is outside the vocabulary (size {vocab})")
    try:
        new, stats = generate(model, torch.tensor([ids]), args.max_new_tokens)
    finally:
        model.weightstream.close()
    token_ids = new[0].tolist()
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "stats": stats.to_dict()}))
    else:
        print(text if text is not None else " ".join(map(str, token_ids)))
        print(summary_line(stats), file=sys.stderr)
    return 0


def summary_line(stats) -> str:
    mib = 2**20
    return (
        f"prefill {stats.prefill_s:.2f} s, decode {stats.decode_tokens_per_s:.2f} tok/s, "
        f"hit rate {stats.expert_hit_rate:.1%}, read {stats.bytes_read / mib:.1f} MiB "
        f"({stats.bytes_read_per_token / mib:.2f} MiB/token), I/O wait {stats.io_wait_s:.2f} s, "
        f"cache {stats.expert_cache_bytes / mib:.0f} MiB ({stats.expert_cache_slots} slots; working set "
        f"{stats.working_set_bytes / mib:.0f} MiB)" + (prediction_line(stats) if stats.predict_next else "")
    )


def prediction_line(stats) -> str:
    return (
        f"; next-layer prediction {stats.prediction_accuracy:.1%} accurate, {stats.readahead_issued} read ahead, "
        f"{stats.readahead_used} used"
    )
