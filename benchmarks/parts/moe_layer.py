"""The native MoE layer and the rows/tiles crossover, alone: what issue 39's kernel changes were measured with.

`layer`: one `moe_layer` call of the OLMoE shape (64 experts of random Q4_K blocks, hidden 2048, intermediate
1024, top-8) on --tokens rows, routed by a seeded softmax; median and best of --calls calls, G multiply-adds a
second, and a checksum of the output (equal across builds: the kernels keep their bits). With --against DIR (the
`src` folder of another checkout whose extension is built), each round runs that build and this one in separate
processes, alternating.

`crossover`: one 2048 x 2048 product per block type at 1-24 rows by AVX2 rows and by tiles (`qmm` paths avx2 and
avx512, or avx2-tiles on a CPU without AVX-512 VNNI), medians in ms: where `auto` should switch to tiles
(`kTileRows`, `kTileRowsAvx2` in csrc/qmm.cpp).

`dequant`: one 2048 x 2048 product per block type at --rows rows, the native product (rows or tiles, as `auto`
takes them) against the weight dequantized once and F.linear, medians in ms at --threads: where a projection
should switch (`NATIVE_DEQUANT_ROWS`, `BF16_DEQUANT_ROWS` in engine/kernels/quantized.py).

    .venv/bin/python benchmarks/kernel_bench.py layer [--threads 2] [--tokens 256] [--calls 9] [--rounds 3]
        [--against OLD/src]
    .venv/bin/python benchmarks/kernel_bench.py crossover [--types Q4_K Q6_K Q8_0]
    .venv/bin/python benchmarks/kernel_bench.py dequant [--types BF16] [--rows 8 16 24 32 64] [--threads 2]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.products import SRC, child
from common.rounds import alternated

_LAYER = """
torch.set_num_threads({threads})
assert native.available(), native.why_not()
hidden, inter, n_experts, top_k, tokens = 2048, 1024, 64, 8, {tokens}
rng = np.random.default_rng(0)
blocks = lambda n, k: torch.from_numpy(random_blocks("Q4_K", n, k, rng))
gate_up = [blocks(2 * inter, hidden) for _ in range(n_experts)]
down = [blocks(hidden, inter) for _ in range(n_experts)]
gen = torch.Generator().manual_seed(1)
x = torch.randn(tokens, hidden, generator=gen)
weights, index = torch.randn(tokens, n_experts, generator=gen).softmax(-1).topk(top_k)
experts = list(range(n_experts))
run = lambda: native.moe_layer(x, index, weights, experts, gate_up, "Q4_K", down, "Q4_K")
times = call_times(run, {calls}, warmup=2)
y = run()
counts = torch.bincount(index.reshape(-1), minlength=n_experts)
macs = tokens * top_k * 3 * hidden * inter
print(json.dumps({{"ms_median": 1e3 * statistics.median(times), "ms_best": 1e3 * min(times),
                  "g_macs_per_s": macs / min(times) / 1e9, "rows_per_expert": [int(counts.min()), int(counts.max())],
                  "checksum": y.double().sum().item()}}))
"""
_CROSSOVER = """
assert native.tiles_available(), "this CPU has no AVX2: there are no tiles to compare"
tiles = "avx512" if native.vnni_available() else "avx2-tiles"
torch.set_num_threads(1)
rng, out, n = np.random.default_rng(0), {{}}, 2048
for wtype in {types!r}:
    w = torch.from_numpy(random_blocks(wtype, n, n, rng))
    out[wtype] = {{}}
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24):
        x = torch.randn(rows, n)
        got = {{}}
        for path in ("avx2", tiles):
            ms = median_ms(lambda: native.qmm(x, w, wtype, n, n, path), 15)
            got["rows_ms" if path == "avx2" else "tiles_ms"] = ms
        out[wtype][rows] = got
print(json.dumps(out))
"""

_DEQUANT = """
from gguf import GGMLQuantizationType, quants
from weightstream.engine.kernels.quantized import native_product
assert native.available(), native.why_not()
torch.set_num_threads({threads})
rng, out, n = np.random.default_rng(0), {{}}, 2048
for wtype in {types!r}:
    kind = getattr(GGMLQuantizationType, wtype)
    try:
        w = torch.from_numpy(quants.quantize((rng.standard_normal((n, n)) * 0.05).astype(np.float32), kind))
    except NotImplementedError:  # a type gguf cannot encode (the K types): random blocks with sane scales
        w = torch.from_numpy(random_blocks(wtype, n, n, rng))
    out[wtype] = {{}}
    for rows in {rows!r}:
        x = torch.randn(rows, n).to(getattr(torch, {dtype!r}))
        got = {{}}
        for route, switch in (("native_ms", float("inf")), ("dequantized_ms", 0)):
            got[route] = median_ms(lambda: native_product(x, w, wtype, n, n, switch), 15)
        out[wtype][rows] = got
print(json.dumps(out))
"""


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    layer = sub.add_parser("layer", help="one MoE layer call, optionally against another build")
    layer.add_argument("--threads", type=int, default=2)
    layer.add_argument("--tokens", type=int, default=256)
    layer.add_argument("--calls", type=int, default=9)
    layer.add_argument("--rounds", type=int, default=3)
    layer.add_argument("--against", help="the src folder of another checkout with its extension built")
    cross = sub.add_parser("crossover", help="rows against tiles at 1-24 rows")
    cross.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    deq = sub.add_parser("dequant", help="the native product against the dequantized weight and F.linear")
    deq.add_argument("--types", nargs="+", default=["BF16"], help="block types (default BF16)")
    deq.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the activations' dtype")
    deq.add_argument("--rows", nargs="+", type=int, default=[8, 16, 24, 32, 64])
    deq.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.what == "crossover":
        print(json.dumps(child(_CROSSOVER, types=args.types), indent=1))
        return
    if args.what == "dequant":
        ms = child(_DEQUANT, types=args.types, rows=args.rows, threads=args.threads, dtype=args.dtype)
        print(json.dumps({"threads": args.threads, "dtype": args.dtype, "ms": ms}, indent=1))
        return
    builds = {"this": SRC} | ({"against": os.path.abspath(args.against)} if args.against else {})
    fields = {"threads": args.threads, "tokens": args.tokens, "calls": args.calls}
    runs = alternated(
        args.rounds,
        {name: (lambda src=src: child(_LAYER, src, **fields)) for name, src in builds.items()},
        lambda r, name, got: print(f"[moe-layer] round {r} {name}: {got}", file=sys.stderr, flush=True),
    )
    rounds = [{name: runs[name][r] for name in builds} for r in range(args.rounds)]
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": rounds}, indent=1))
