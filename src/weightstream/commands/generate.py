"""`weightstream generate`: greedy generation with experts streamed from disk through a fixed-budget cache."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from weightstream.commands.common import (
    add_engine_options,
    add_prefill_chunk_option,
    add_shard_options,
    engine_config,
    miss_copy_note,
    parse_prompt_ids,
    prefill_chunk_of,
    ray_for_shards,
    shard_options,
    summary_line,
)
from weightstream.errors import WeightstreamError


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text, streaming experts from the checkpoint",
        description="Load a Mixture-of-Experts checkpoint with only its dense weights in memory and stream "
        "experts from disk through a fixed-budget expert cache (O_DIRECT, dedicated I/O threads, reads "
        "overlapped with compute). Tokens equal the in-memory model's (not with --miss-copy; DeepSeek's latent "
        "attention, absorbed by default, gives its logits within float32 rounding: --latent-attention expanded "
        "for its exact ones; gpt-oss's attention over long prompts and caches likewise, and grouped-query "
        "attention over a long cache). Greedy by default.",
        epilog="examples:\n  weightstream generate models/olmoe --prompt 'Hello' --expert-cache 2GiB\n"
        "  weightstream generate models/olmoe --prompt-ids 1,2,3 --max-new-tokens 16 --json\n"
        "  weightstream generate models/olmoe-q4k --prompt 'Hello' --expert-shards 3",
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
    add_prefill_chunk_option(p)
    add_shard_options(p)
    p.add_argument(
        "--routing-trace",
        metavar="TRACE.npz",
        help="benchmarks: replay this routing trace instead of the router, from its first token; reads and compute "
        "are real, the text is meaningless",
    )
    p.add_argument(
        "--json", action="store_true", help='print one JSON object: {"token_ids": [...], "text": ..., "stats": {...}}'
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from weightstream.store.model_dir import resolve_model

    # what can be refused without torch and transformers is refused before them (they take seconds to import)
    if args.max_new_tokens < 1:
        raise WeightstreamError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    ids = parse_prompt_ids(args.prompt_ids) if args.prompt is None else None
    chunk = prefill_chunk_of(args)
    shards = shard_options(args)
    if args.ray_address and shards is None:
        raise WeightstreamError("--ray-address places expert shards: give --expert-shards N with it")
    model_dir = resolve_model(args.model)

    from weightstream.engine.loader import load_tokenizer
    from weightstream.store.checkpoint import open_checkpoint

    engine = engine_config(args)
    open_checkpoint(model_dir)  # a directory that is no model is told so, not that it lacks a tokenizer
    tokenizer = load_tokenizer(model_dir, required=args.prompt is not None)
    ids = tokenizer(args.prompt).input_ids if ids is None else ids
    if not ids:
        raise WeightstreamError(f"--prompt {args.prompt!r}: no tokens to start from; give a non-empty prompt")
    _check_prompt(model_dir, ids, args.max_new_tokens)
    if args.memory is not None:  # the KV cache this generation needs, and a warm-up as long as its longest forward
        engine = engine.replace(context=len(ids) + args.max_new_tokens, warmup_tokens=min(len(ids), chunk))
    trace = _trace(args.routing_trace)  # read before the model, so that --memory counts it with what came before
    # Ray connected before the model, so that --memory counts Ray's share of this process too; what Ray prints (a
    # shard's death) goes to stderr, so that stdout holds the answer alone
    with ray_for_shards(shards), contextlib.redirect_stdout(sys.stderr if shards else sys.stdout):
        answer = _generate(args, model_dir, engine, tokenizer, ids, chunk, shards, trace)
    print(answer)
    return 0


def _generate(args, model_dir, engine, tokenizer, ids, chunk, shards, trace) -> str:
    """What generate prints on stdout (the text, or the --json object); the summary line goes to stderr."""
    import torch

    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model
    from weightstream.engine.routing import RoutingReplay

    model = load_streaming_model(model_dir, engine)
    if trace is not None:
        model.weightstream.routing_override = RoutingReplay(trace, model.weightstream.layout)
    if args.miss_copy:
        print(miss_copy_note("generate"), file=sys.stderr)
    guard = model.weightstream.file_guard
    weight_files = guard.report() if guard is not None else None  # before close gives the leases up
    try:
        with _shards(shards, model, model_dir) as placement:
            new, stats = generate(model, torch.tensor([ids]), args.max_new_tokens, prefill_chunk=chunk)
            if placement is not None:
                placement["traffic"] = model.weightstream.shards.report()  # per shard, as the head measured
    finally:
        model.weightstream.close()
    token_ids = new[0].tolist()
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        from weightstream.bench.machine import read_bandwidth

        report = stats.to_dict()
        footprint = model.weightstream.footprint
        report["memory"] = footprint.to_dict() if footprint is not None else None
        report["engine"] = engine.to_dict()  # every option the engine ran with, defaults included
        report["weight_files"] = weight_files  # guarded against writes under the model (engine/file_guard.py)
        report["expert_shards"] = (
            placement  # the plan as built and each shard's traffic (engine/shard_ray.py); None: none
        )
        bandwidth = read_bandwidth()  # measured once on a machine, then kept
        report["read_bandwidth_bytes_per_s"] = bandwidth
        report["weight_bytes_per_s"] = stats.weight_bytes_per_token * stats.decode_tokens_per_s
        report["share_of_read_bandwidth"] = report["weight_bytes_per_s"] / bandwidth
        return json.dumps({"token_ids": token_ids, "text": text, "stats": report})
    print(summary_line(stats), file=sys.stderr)
    return text if text is not None else " ".join(map(str, token_ids))


def _trace(path: str | None):
    if path is None:
        return None
    if not os.path.isfile(path):
        raise WeightstreamError(f"--routing-trace {path}: no such file; give a routing trace (.npz)")
    from weightstream.trace import load

    return load(path)


def _shards(options, model, model_dir: str):
    """`--expert-shards`: the model's experts on shard actors for the block, which yields their plan (None without
    shards)."""
    if options is None:
        return contextlib.nullcontext()
    from weightstream.engine.shard_ray import sharded

    return sharded(model, model_dir, options)


def _check_prompt(model_dir: str, ids: list[int], new: int) -> None:
    """Refuses, before the model loads, a token id outside the vocabulary and a prompt plus new tokens past the
    model's positions (as serve does)."""
    from weightstream.store.model import load_config

    config = load_config(model_dir).get_text_config()
    vocab = config.vocab_size
    if max(ids) >= vocab:
        raise WeightstreamError(f"--prompt-ids: token id {max(ids)} is outside the vocabulary (size {vocab})")
    prompt, limit = len(ids), getattr(config, "max_position_embeddings", None)
    if limit is None or prompt + new <= limit:
        return
    if prompt >= limit:
        raise WeightstreamError(
            f"the prompt is {prompt} tokens and {model_dir} has {limit} positions (max_position_embeddings), "
            "which leaves no room for an answer; shorten the prompt"
        )
    raise WeightstreamError(
        f"--max-new-tokens {new}: a {prompt}-token prompt plus {new} new tokens is {prompt + new} positions, past "
        f"the {limit} of {model_dir} (max_position_embeddings); ask for at most {limit - prompt}"
    )
