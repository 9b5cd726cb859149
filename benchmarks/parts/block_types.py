"""Every block type's product on the native kernels: GB/s of weights read and weights a second, --rows rows of
activations (default 1: decode) against an N x K matrix of random blocks (sane scales, every code pattern), median
of --calls calls. From 6 rows the product runs as multi-row tiles where the CPU has AVX-512 with VNNI; g_weights_per_s
counts every row's weights (N K rows a second), so it compares across row counts.

With --against DIR (the `src` folder of another checkout whose extension is built, e.g. a `git worktree` of an
earlier commit), each round times that build and this one in separate processes, alternating, so the two are
compared back to back; the types that build lacks are left out of its rows. With --against-llamacpp, each round
also times llama.cpp's own product of each type on the same shape and threads (benchmarks/ggml_product.c through
ggml's CPU backend, its path with --repack 0), and the report gives this build's ratio to it per round.

    .venv/bin/python benchmarks/llamacpp.py products [--threads 1] [--rounds 2] [--against /path/to/old/src]
        [--against-llamacpp] [--types MXFP4 --n 5760 --k 2880] [--rows 256] [--out benchmarks/results/block-types.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common.products import SRC, child
from common.results import default, emit

_CHILD = """
torch.set_num_threads({threads})
assert native.available(), native.why_not()
rng, out = np.random.default_rng(0), {{}}
for wtype in [t for t in {types!r} if t in native.TYPE_IDS and t != "BF16"]:
    w, x = torch.from_numpy(random_blocks(wtype, {n}, {k}, rng)), torch.randn({rows}, {k})
    t = statistics.median(call_times(lambda: native.qmm(x, w, wtype, {n}, {k}), {calls}, warmup=5))
    out[wtype] = {{"gb_per_s": w.numel() / t / 1e9, "g_weights_per_s": {rows} * {n} * {k} / t / 1e9}}
print(json.dumps(out))
"""
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "MXFP4")


def run(src: str, args) -> dict:
    fields = {"threads": args.threads, "types": args.types, "n": args.n, "k": args.k, "rows": args.rows}
    return child(_CHILD, src, failed=src, timeout=1800, calls=args.calls, **fields)


def run_llamacpp(tool: str, args) -> dict:
    """llama.cpp's product of each type (ggml names them q4_K, mxfp4, ...), as `run` reports this build's."""
    out = {}
    for wtype in args.types:
        name = wtype.lower() if wtype == "MXFP4" else "q" + wtype[1:]
        cmd = [tool, name, str(args.n), str(args.k), str(args.threads), str(args.calls), str(args.rows)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: {done.stderr[-1500:]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        out[wtype] = {"gb_per_s": found["gb_per_s"], "g_weights_per_s": found["g_weights_per_s"]}
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=4096, help="output rows (default 4096)")
    ap.add_argument("--k", type=int, default=4096, help="inputs, a multiple of 256 (default 4096)")
    ap.add_argument("--rows", type=int, default=1, help="rows of activations (default 1: decode; 256: a prompt)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--against", help="the src folder of another checkout with its extension built")
    ap.add_argument("--against-llamacpp", action="store_true", help="also time llama.cpp's product of each type")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES, metavar="TYPE", help="default: all")
    ap.add_argument("--out", default=default("block-types.json"))
    args = ap.parse_args(argv)
    llamacpp = None
    if args.against_llamacpp:
        import llamacpp as peer

        llamacpp = peer.product_tool()
        if llamacpp is None:
            raise SystemExit("--against-llamacpp: llama.cpp could not be built here (see above)")
    rounds = []
    for r in range(args.rounds):
        builds = {"this": SRC} | ({"against": args.against} if args.against else {})
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        if llamacpp is not None:
            order.insert(r % 2 * len(order), "llama.cpp")  # first in even rounds, last in odd ones
        rounds.append(
            {
                name: run_llamacpp(str(llamacpp), args) if name == "llama.cpp" else run(builds[name], args)
                for name in order
            }
        )
        print(f"[block-types] round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
        "shape": [args.n, args.k],
        "rows": args.rows,
        "rounds": rounds,
    }
    if llamacpp is not None:
        report["ratio_to_llamacpp"] = {
            t: [round(r["this"][t]["gb_per_s"] / r["llama.cpp"][t]["gb_per_s"], 3) for r in rounds] for t in args.types
        }
    emit(report, args.out)
