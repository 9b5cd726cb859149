"""The native kernels and the steps between them, against the routes they replace: each subcommand's baseline runs
in the same run (another checkout's build with --against, the dequantized weight and F.linear, torch's own ops).

    layer       one native MoE layer call of the OLMoE shape (64 random Q4_K experts, 256 tokens top-8): ms, G
                multiply-adds a second, an output checksum; against another build (--against), alternated
    crossover   rows against tiles at 1-24 rows per block type (where `auto` switches to tiles)
    dequant     the native product against the dequantized weight and F.linear (where a projection switches)
    routes      each route for one quantized projection by rows per expert (engine/kernels/quantized.py:
                DEQUANT_ROWS), against bf16 F.linear
    steps       what the steps between the products cost a decode token: the fused ops against transformers',
                the engine's KV cache against DynamicCache, paired token by token

    .venv/bin/python benchmarks/kernel_bench.py layer --rounds 3 --against OLD/src
    .venv/bin/python benchmarks/kernel_bench.py crossover --types Q4_K Q6_K Q8_0
    .venv/bin/python benchmarks/kernel_bench.py dequant --types Q4_K Q6_K Q8_0 --rows 32 256 --dtype bfloat16
    .venv/bin/python benchmarks/kernel_bench.py routes --hidden 2048 --intermediate 1024
    .venv/bin/python benchmarks/kernel_bench.py steps MODEL --tokens 400 --out benchmarks/results/decode-steps.json

`layer`, `crossover`, `dequant` and `routes` print JSON only; `steps` also writes it to --out. Every block type's
product against llama.cpp's is `llamacpp.py products`. The subcommands run parts/moe_layer.py (layer, crossover,
dequant), parts/quant_kernels.py (routes) and parts/decode_steps.py (steps); `kernel_bench.py PART --help`.
"""

from __future__ import annotations

from common import Part, entry

PARTS = {
    "layer": Part("moe_layer", "one native MoE layer call, optionally against another build", named=True),
    "crossover": Part("moe_layer", "rows against tiles at 1-24 rows per block type", named=True),
    "dequant": Part("moe_layer", "the native product against the dequantized weight and F.linear", named=True),
    "routes": Part("quant_kernels", "each route for one quantized projection by rows per expert, against bf16"),
    "steps": Part("decode_steps", "fused ops and the engine's KV cache against transformers', per decode token"),
}

if __name__ == "__main__":
    entry("kernel_bench.py", __doc__, PARTS)
