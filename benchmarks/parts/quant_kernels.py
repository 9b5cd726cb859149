"""Which kernel computes one quantized expert projection fastest, by rows per expert: the numbers behind
`engine.kernels.quantized.DEQUANT_ROWS`, the int4 group-size default, and how close each kernel comes to the machine's
memory bandwidth.

For each weight shape of the model (gate_up and down of one expert, or one square matrix with --square N) and each
row count M (1 = batch-1 decode, more = prefill or batched serving): bf16 F.linear (the unquantized baseline),
int8 through `_weight_int8pack_mm`, int4 through `_weight_int4pack_mm_for_cpu` per group size, the native kernels
on GGML blocks (Q8_0, Q4_K, Q4_1: native.py), and each dequantized then F.linear. Medians of many calls, in
one process, on this machine's threads. Prints JSON with the crossover row counts and, at M = 1, each route's
weight bytes per second against the machine's read bandwidth (a float32 sum of 1 GiB). Examples:

    .venv/bin/python benchmarks/kernel_bench.py routes --hidden 2048 --intermediate 1024
    .venv/bin/python benchmarks/kernel_bench.py routes --square 8192 --rows 1 --groups 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from common.products import median_ms

from weightstream import native
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.torch_codes import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    torch_int4_layout,
    unpack_int4,
)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def routes(w: torch.Tensor, groups: tuple[int, ...]) -> tuple[dict, dict]:
    """(name -> fn(x): every way to compute x @ w.T from w's stored forms, name -> bytes that form reads)."""
    layout = torch_int4_layout()
    n, k = w.shape
    q8, s8 = quantize_int8(w, w.dtype)
    out = {
        "bf16": lambda x: F.linear(x, w),
        "int8-kernel": lambda x: torch._weight_int8pack_mm(x, q8, s8),
        "int8-dequant": lambda x: F.linear(x, dequantize_int8(q8, s8)),
    }
    nbytes = {"bf16": w.nbytes, "int8-kernel": q8.nbytes + s8.nbytes}
    for g in groups:
        q, sz = quantize_int4(w, g, w.dtype)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        out[f"int4-g{g}-kernel"] = lambda x, p=packed, s=sz, g=g: torch._weight_int4pack_mm_for_cpu(x, p, g, s)
        out[f"int4-g{g}-dequant"] = lambda x, p=packed, s=sz, g=g: F.linear(
            x, dequantize_int4(unpack_int4(p, layout), s, g)
        )
        nbytes[f"int4-g{g}-kernel"] = packed.nbytes + sz.nbytes
    if native.available():
        for wtype, encode in ENCODERS.items():
            if k % (256 if wtype == "Q4_K" else 32):
                continue
            blocks = encode(w).reshape(-1)
            out[f"{wtype}-native"] = lambda x, b=blocks, t=wtype: native.qmm(x, b, t, n, k).to(x.dtype)
            out[f"{wtype}-dequant"] = lambda x, b=blocks, t=wtype: F.linear(
                x, native.dequantize(b, t, n, k).to(x.dtype)
            )
            nbytes[f"{wtype}-native"] = blocks.nbytes
    return out, nbytes


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over 1 GiB (best of `repeats`): what reading memory costs here."""
    t = torch.ones(2**28)
    best = min(median_ms(lambda: t.sum(), 1) for _ in range(repeats))
    return t.nbytes / (best / 1000)


def crossover(times: dict, kernel: str, dequant: str, rows: tuple[int, ...] = ROWS) -> int | None:
    """The smallest row count from which the dequantized route is faster for good."""
    for m in rows:
        if all(times[n][dequant] < times[n][kernel] for n in rows if n >= m):
            return m
    return None


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--groups", default="32,64,128,256")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--square", type=int, metavar="N", help="one N x N matrix instead of an expert's shapes")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M to time (comma-separated)")
    args = ap.parse_args(argv)
    groups = tuple(int(g) for g in args.groups.split(","))
    rows = tuple(int(m) for m in args.rows.split(","))
    gen = torch.Generator().manual_seed(0)
    report = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "int4_layout": torch_int4_layout(),
        "native": native.best_path() if native.available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "read_bandwidth_gb_s": read_bandwidth() / 1e9,
        "shapes": {},
    }
    shapes = (
        {"square": (args.square, args.square)}
        if args.square
        else {"gate_up": (2 * args.intermediate, args.hidden), "down": (args.hidden, args.intermediate)}
    )
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        fns, nbytes = routes(w, groups)
        times = {m: {} for m in rows}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for route, fn in fns.items():
                calls = args.repeats if m <= 64 else max(5, args.repeats // 4)
                times[m][route] = median_ms(lambda f=fn, x=x: f(x), calls)
        pairs = {"int8": ("int8-kernel", "int8-dequant")}
        pairs |= {f"int4-g{g}": (f"int4-g{g}-kernel", f"int4-g{g}-dequant") for g in groups}
        pairs |= {t: (f"{t}-native", f"{t}-dequant") for t in ENCODERS if f"{t}-native" in fns}
        cross = {key: crossover(times, *pair, rows) for key, pair in pairs.items()}
        at_one = {
            route: {
                "gb_s": nbytes[route] / (times[1][route] / 1000) / 1e9,
                "weights_g_s": n * k / (times[1][route] / 1000) / 1e9,
                "of_read_bandwidth": nbytes[route] / (times[1][route] / 1000) / report["read_bandwidth_gb_s"] / 1e9,
            }
            for route in nbytes
            if 1 in times
        }
        report["shapes"][name] = {"out_in": [n, k], "ms": times, "dequant_from_rows": cross, "at_one_row": at_one}
    print(json.dumps(report, indent=1))
