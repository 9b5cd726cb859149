"""`weightstream synth`: write a synthetic MoE checkpoint (random weights, real shapes) with a local tokenizer."""

from __future__ import annotations

import json


def register(sub) -> None:
    from weightstream.store.presets import PRESETS, REAL, TINY

    p = sub.add_parser(
        "synth",
        help="write a synthetic MoE checkpoint with random weights and a tokenizer (no download)",
        description="Write a transformers-loadable checkpoint with random weights, in the architecture's own "
        "on-disk form (sharded safetensors + index, config.json, tokenizer). Presets: `tiny` (tests; pick "
        f"--arch) or real models' shapes: {', '.join(REAL)}. --layers shrinks them.",
        epilog="example: weightstream synth --preset olmoe-1b-7b --layers 4 --out models/olmoe-4l",
    )
    p.add_argument("--preset", required=True, choices=PRESETS, help="model shape")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create (must be empty unless --force)")
    p.add_argument("--arch", default="qwen3_moe", choices=sorted(TINY), help="architecture of the tiny preset")
    p.add_argument("--layers", type=int, help="number of decoder layers (shrinks a real preset)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"), help="weight dtype (default bf16)")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a directory weightstream wrote (nothing else)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from weightstream.progress import byte_progress
    from weightstream.store.presets import preset_config
    from weightstream.store.synth import synthesize

    fields = preset_config(args.preset, args.arch, args.layers)
    with byte_progress(f"writing {args.out}") as progress:
        result = synthesize(args.out, fields, args.dtype, args.seed, args.force, progress)
    summary = {
        "out": result.out_dir,
        "model_type": result.model_type,
        "bytes": result.total_bytes,
        "shards": result.shards,
        "layers": fields["num_hidden_layers"],
        "dtype": args.dtype,
    }
    print(
        json.dumps(summary)
        if args.json
        else f"wrote {result.out_dir}: {result.model_type}, {fields['num_hidden_layers']} layers, "
        f"{result.total_bytes / 2**20:.1f} MiB in {result.shards} shards ({args.dtype})"
    )
    return 0
