"""`weightstream quantize`: int8 or int4 experts, stored the way the engine reads and computes them."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="rewrite a checkpoint's experts as int8 or int4 (a quarter of the bytes per miss at 4 bits)",
        description="Quantize every routed expert of MODEL_DIR by round-to-nearest, in blocks of 32 inputs for "
        "weightstream's native kernels (Q8_0, Q4_K, Q4_1: GGML's block formats, docs/kernels.md) or in torch's "
        "packed layouts (--kernel torch). Each expert becomes one blob in the layout its kernel takes, so a cache "
        "miss is one O_DIRECT read and nothing is repacked; dense "
        "weights (attention, norms, router, embeddings, shared experts) keep their precision. The result is a "
        "model directory that generate, bench, trace record, simulate and serve take as they are. It streams: one "
        "expert at a time, never the whole model in memory; the output appears only when complete.",
        epilog="examples:\n  weightstream quantize models/olmoe --bits 4 --out models/olmoe-int4\n"
        "  weightstream quantize models/olmoe --bits 8 --out models/olmoe-int8 --force\n"
        "  weightstream quantize models/olmoe --bits 16 --dense bf16 --out models/olmoe-bf16-native\n"
        "  weightstream quantize models/olmoe --bits 4 --miss-bits 2 --out models/olmoe-q4-miss2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument(
        "--bits",
        type=int,
        required=True,
        choices=(8, 4, 16),
        help="8 or 4 bits per expert weight; 16: bf16 experts, not quantized, on the native kernels (with --dense "
        "bf16, a bf16 model that runs every product natively)",
    )
    p.add_argument(
        "--kernel",
        choices=("auto", "native", "torch"),
        default="auto",
        help="native: GGML blocks for weightstream's native kernels (8: Q8_0; 4: Q4_K, or Q4_1 where an input "
        "size is not a multiple of 256); torch: torch's packed layouts (8: one scale per output channel; 4: "
        "--group-size groups). auto (default): native where the kernels are built and no --group-size is given",
    )
    p.add_argument(
        "--dense",
        choices=("keep", "int8", "int4", "bf16"),
        default="keep",
        help="also quantize the dense linear weights (attention, shared experts, dense MLPs, an untied output "
        "head; never the router, norms or embeddings) for the native kernels: int8 (Q8_0), int4 (Q4_K, or Q4_1) or "
        "bf16 (not quantized). Default keep: their source precision, run by torch",
    )
    p.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="torch int4 only: inputs per scale/zero, one of 32, 64, "
        "128, 256 (default 128; docs/quantization.md, 'Choosing the group size', gives the measured reason)",
    )
    p.add_argument(
        "--miss-bits",
        type=int,
        choices=(2, 3),
        metavar="{2,3}",
        help="also write a small copy of every expert beside its blob: Q2_K (2, 2.6 bits a weight) or Q3_K (3, 3.4 "
        "bits), from the source weights; a weight whose inputs are not whole blocks of 256 is Q4_0 in it (said). "
        "`generate/serve/bench --miss-copy` then read the small copy on a cache miss (fewer bytes) and the full one "
        "when the expert comes back; tokens then are not the model's exact ones, so it is never the default. Native "
        "kernels only (docs/quantization.md, 'Small copies for misses')",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create (must be empty unless --force)")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a directory weightstream wrote (nothing else)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from weightstream.progress import byte_progress
    from weightstream.store.quant.options import QuantizeOptions
    from weightstream.store.quant.pipeline import quantize_checkpoint

    options = QuantizeOptions(args.bits, args.group_size, args.kernel, args.dense, args.miss_bits)
    target = "bf16 blocks" if args.bits == 16 else f"int{args.bits}"
    with byte_progress(f"quantizing {args.model} to {target}") as progress:
        result = quantize_checkpoint(args.model, args.out, force=args.force, progress=progress, options=options)
    summary = {
        "out": result.out_dir,
        "scheme": result.scheme,
        "group_size": result.group_size,
        "experts": result.experts,
        "expert_bytes_before": result.expert_bytes_before,
        "expert_bytes_after": result.expert_bytes_after,
        "bytes": result.total_bytes,
        "seconds": result.seconds,
    }
    if result.miss_bits is not None:
        summary.update(
            miss_bits=result.miss_bits,
            miss_copy_bytes=result.miss_copy_bytes,
            miss_copy_fallback=result.miss_fallback,
        )
    ratio = result.expert_bytes_after / result.expert_bytes_before
    group = f" (groups of {result.group_size})" if result.group_size else ""
    print(
        json.dumps(summary)
        if args.json
        else f"wrote {result.out_dir}: {result.experts} experts as {result.scheme}{group}, "
        f"{result.expert_bytes_after / 2**20:.2f} MiB each ({ratio:.2f}x of {result.expert_bytes_before / 2**20:.2f} "
        f"MiB), {result.total_bytes / 2**30:.2f} GiB in all, {result.seconds:.1f} s" + _miss_line(result)
    )
    return 0


def _miss_line(result) -> str:
    if result.miss_bits is None:
        return ""
    fallback = "".join(
        f"; {name} as {t} (its inputs are not whole blocks of 256)" for name, t in result.miss_fallback.items()
    )
    return (
        f"\nsmall copies for misses: Q{result.miss_bits}_K, {result.miss_copy_bytes / 2**20:.2f} MiB each "
        f"({result.miss_copy_bytes / result.expert_bytes_after:.2f}x of the blob){fallback}; run with --miss-copy"
    )
