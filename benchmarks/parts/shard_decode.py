"""Decode with the experts on shards against one process holding them (issue 51): `weightstream generate
--expert-shards N` against the same command without it, on the same model, rounds alternated.

Each run is a fresh `weightstream generate MODEL --prompt-ids ... --max-new-tokens T --json` process, with an expert
cache that holds every expert (`--expert-cache` EXPERT_CACHE, default 100x: read once, then resident) so that the
difference is the shards' (a Ray cluster started by the command, N actors each holding its share in memory, one
round trip a layer) and not the disk. Reported per run: decode tok/s, prefill seconds, the tokens; per round the
ratio sharded / one process; the tokens must be equal. Root is not needed; nothing else should run.

    .venv/bin/python benchmarks/serve_bench.py shard-decode .work/olmoe4/q4 --shards 2 --rounds 3 \\
        --out benchmarks/results/shard-decode-olmoe4.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common.results import default, emit

from weightstream.bench.calibration_store import cpu_model


def _run(model: str, args, shards: int) -> dict:
    cmd = [sys.executable, "-m", "weightstream.cli", "generate", model, "--prompt-ids", args.prompt_ids]
    cmd += ["--max-new-tokens", str(args.tokens), "--expert-cache", args.expert_cache, "--json"]
    if shards:
        cmd += ["--expert-shards", str(shards)]
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    stats = out["stats"]
    return {
        "decode_tok_s": stats["decode_tokens_per_s"],
        "prefill_s": stats.get("prefill_s"),
        "wall_s": round(time.monotonic() - start, 1),
        "token_ids": out["token_ids"],
    }


def main(argv=None, prog: str = "serve_bench.py shard-decode") -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model directory with native GGML-block experts (quantize or import)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a run (default 32)")
    ap.add_argument("--prompt-ids", default="3,17,101,250,7,42,311,5")
    ap.add_argument("--expert-cache", default="100x", help="the head's cache in both runs (default 100x: all)")
    ap.add_argument("--out", default=default("shard-decode.json"))
    args = ap.parse_args(argv)
    rounds = []
    for r in range(args.rounds):
        order = (0, args.shards) if r % 2 == 0 else (args.shards, 0)
        runs = {("sharded" if s else "one process"): _run(args.model, args, s) for s in order}
        one, sharded = runs["one process"], runs["sharded"]
        if one["token_ids"] != sharded["token_ids"]:
            raise SystemExit(f"round {r}: the sharded tokens differ from one process's")
        rounds.append({**runs, "ratio": round(sharded["decode_tok_s"] / one["decode_tok_s"], 3)})
    emit(
        {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "model": args.model,
            "shards": args.shards,
            "tokens": args.tokens,
            "rounds": rounds,
            "ratio_median": statistics.median(r["ratio"] for r in rounds),
            "tokens_equal": True,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
