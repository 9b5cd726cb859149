"""Which kernel computes one quantized expert projection fastest, by rows per expert: the numbers behind
`engine.kernels.DEQUANT_ROWS` and the int4 group-size default.

For each weight shape of the model (gate_up and down of one expert) and each row count M (1 = batch-1 decode,
more = prefill or batched serving): bf16 F.linear (the unquantized baseline), int8 through
`_weight_int8pack_mm`, int8 dequantized then F.linear, int4 through `_weight_int4pack_mm_for_cpu` per group size,
int4 unpacked and dequantized then F.linear. Medians of many calls, in one process, on this machine's threads.
Prints JSON with the crossover row counts. Example:

    .venv/bin/python benchmarks/quant_kernels.py --hidden 2048 --intermediate 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from weightstream.store.quant import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    torch_int4_layout,
    unpack_int4,
)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1000


def routes(w: torch.Tensor, groups: tuple[int, ...]) -> dict:
    """name -> fn(x): every way to compute x @ w.T from w's stored forms."""
    layout = torch_int4_layout()
    q8, s8 = quantize_int8(w, w.dtype)
    out = {
        "bf16": lambda x: F.linear(x, w),
        "int8-kernel": lambda x: torch._weight_int8pack_mm(x, q8, s8),
        "int8-dequant": lambda x: F.linear(x, dequantize_int8(q8, s8)),
    }
    for g in groups:
        q, sz = quantize_int4(w, g, w.dtype)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        out[f"int4-g{g}-kernel"] = lambda x, p=packed, s=sz, g=g: torch._weight_int4pack_mm_for_cpu(x, p, g, s)
        out[f"int4-g{g}-dequant"] = lambda x, p=packed, s=sz, g=g: F.linear(
            x, dequantize_int4(unpack_int4(p, layout), s, g)
        )
    return out


def crossover(times: dict, kernel: str, dequant: str) -> int | None:
    """The smallest row count from which the dequantized route is faster for good."""
    for m in ROWS:
        if all(times[n][dequant] < times[n][kernel] for n in ROWS if n >= m):
            return m
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--groups", default="32,64,128,256")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    groups = tuple(int(g) for g in args.groups.split(","))
    gen = torch.Generator().manual_seed(0)
    report = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "int4_layout": torch_int4_layout(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shapes": {},
    }
    for name, (n, k) in {
        "gate_up": (2 * args.intermediate, args.hidden),
        "down": (args.hidden, args.intermediate),
    }.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        fns = routes(w, groups)
        times = {m: {} for m in ROWS}
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for route, fn in fns.items():
                times[m][route] = timed(lambda f=fn, x=x: f(x), args.repeats if m <= 64 else max(5, args.repeats // 4))
        cross = {"int8": crossover(times, "int8-kernel", "int8-dequant")}
        cross |= {f"int4-g{g}": crossover(times, f"int4-g{g}-kernel", f"int4-g{g}-dequant") for g in groups}
        report["shapes"][name] = {"out_in": [n, k], "ms": times, "dequant_from_rows": cross}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
