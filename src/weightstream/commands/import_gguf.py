"""`weightstream import`: a GGUF file (llama.cpp's format) as a model directory, its blocks as they are."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "import",
        help="make a GGUF file (llama.cpp) a model directory every command takes, weights kept in their blocks",
        description="Write MODEL.gguf as a model directory: config.json and the tokenizer from the file's metadata, "
        "every routed expert as one blob of its GGML blocks exactly as the file stores them (Q8_0, Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, BF16: the types weightstream's native kernels run), and "
        "the dense linear weights (attention, output head, shared experts) of those types as their blocks too. The "
        "token embedding, router, norms and dense weights of other types are stored in the activation dtype "
        "(bfloat16, or float32 when every such matrix is F32; dequantized where the file quantized them). Expert "
        "block types the kernels do not run (IQ*, TQ*, F16, ...) are requantized (--requantize), and every lossy "
        "step is said on stderr with its measured error. A split model (NAME-00001-of-0000N.gguf) is read from all "
        "its parts. It streams: one tensor or one expert at a time; the output appears only when complete. "
        "Architectures: qwen3moe, qwen2moe, olmoe, llama (Mixtral), deepseek2 (DeepSeek-V2/V3, Kimi-K2), glm4moe "
        "(GLM-4.5), gpt-oss (docs/gguf.md).",
        epilog="examples:\n  weightstream import Qwen3-30B-A3B-Q4_K_M.gguf --out models/qwen3-30b-q4km\n"
        "  weightstream import gpt-oss-20b-mxfp4.gguf --out models/gpt-oss-20b --json\n"
        "  weightstream import Kimi-K2-Q2_K-00001-of-00008.gguf --out models/kimi-k2-q2k\n"
        "  weightstream generate models/qwen3-30b-q4km --prompt 'Hello' --expert-cache 4GiB",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("gguf", metavar="MODEL.gguf", help="the GGUF file (for a split model, any of its parts)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create (must be empty unless --force)")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a directory weightstream wrote (nothing else)"
    )
    p.add_argument(
        "--requantize",
        choices=("auto", "q8_0", "q4_k"),
        default="auto",
        help="what expert types the native kernels do not run (IQ4_NL, IQ2_XS, TQ1_0, F16, ...) become: auto "
        "(default) Q4_K for types of at most 4.5 bits a weight, else Q8_0; the error is measured and printed",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from weightstream.store.outdir import refuse_existing

    refuse_existing(args.out, args.force, sources=[args.gguf])  # before torch and transformers (seconds to import)

    from weightstream.progress import byte_progress
    from weightstream.store.gguf_import import import_gguf

    notes: list[str] = []
    with byte_progress(f"importing {args.gguf}") as progress:
        result = import_gguf(args.gguf, args.out, args.force, progress, args.requantize, log=notes.append)
    for line in notes:  # after the progress display is gone
        print(f"weightstream import: {line}", file=sys.stderr)
    summary = {
        "out": result.out_dir,
        "architecture": result.architecture,
        "model_type": result.model_type,
        "scheme": result.scheme,
        "activation_dtype": result.activation_dtype,
        "experts": result.experts,
        "expert_types": result.expert_types,
        "dense_blocks": result.dense_blocks,
        "layer_tables": result.layer_tables,
        "requantized": result.requantized,
        "tokenizer": result.tokenizer,
        "bytes": result.total_bytes,
        "gguf_bytes": result.gguf_bytes,
        "seconds": result.seconds,
    }
    types = ", ".join(f"{n} {k}" for k, n in sorted(result.expert_types.items()))
    experts = f"as {result.scheme} blobs ({types} tensors)" if result.scheme else f"unquantized ({types} tensors)"
    blocks = ", ".join(f"{n} {k}" for k, n in sorted(result.dense_blocks.items()))
    dense = f"{blocks} as blocks, the rest {result.activation_dtype}" if blocks else result.activation_dtype
    print(
        json.dumps(summary)
        if args.json
        else f"wrote {result.out_dir}: {result.model_type} from {result.architecture} GGUF, {result.experts} experts "
        f"{experts}, dense weights {dense}, {result.total_bytes / 2**30:.2f} GiB from "
        f"{result.gguf_bytes / 2**30:.2f} GiB, {result.seconds:.1f} s"
    )
    return 0
