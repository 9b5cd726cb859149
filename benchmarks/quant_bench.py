"""Quantized experts end to end, bf16 beside int8 and int4 of the same weights, against llama.cpp where it runs.

1. bytes: one expert's bytes in each format (scales included), as ratios to bf16.
2. in memory: decode with every expert resident (own process, no limit, repeats interleaved), per format.
3. under --limit (default 5 GiB) with expert caches of equal bytes (--equal-bytes, default 1.5GiB,3GiB): decode
   tok/s and device bytes read per token of each format; tokens against each format's own in-memory reference.
4. under --small-limit (default 2 GiB, below the int4 model's size): weightstream int4 at --small-cache against
   llama.cpp Q4_K_M of the same weights through mmap (GGUF made by llama.cpp's converter and quantizer, run time
   capped at --llama-timeout; a timeout is reported as such). `--llamacpp` also times llama.cpp in memory.

    .venv/bin/python benchmarks/quant_bench.py .work/bench-models/olmoe-16l-bf16 \\
        --int8 .work/bench-models/olmoe-16l-int8 --int4 .work/bench-models/olmoe-16l-int4 --llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llamacpp  # noqa: E402

from weightstream.bench.machine import block_device_of, machine_info  # noqa: E402
from weightstream.bench.runner import BenchConfig, child_config, run_bench, run_child, summarize  # noqa: E402
from weightstream.engine.prompts import tokenized_prompts  # noqa: E402
from weightstream.store.model import map_model  # noqa: E402
from weightstream.units import parse_size  # noqa: E402

KEEP = (
    "expert_cache",
    "decode_tokens_per_s",
    "expert_hit_rate",
    "decode_bytes_read_per_token",
    "bytes_read_per_token",
    "device_bytes_read",
    "io_wait_s",
    "cgroup_peak_bytes",
    "peak_rss_bytes",
    "token_ids_equal_to_reference",
    "error",
)


def expert_bytes(models: dict[str, str]) -> dict:
    sizes = {name: next(iter(map_model(path).layout.experts.values())).nbytes for name, path in models.items()}
    return {"bytes": sizes, "ratio_to_bf16": {name: b / sizes["bf16"] for name, b in sizes.items()}}


def in_memory(models: dict[str, str], prompts, tokens: int, repeats: int) -> dict:
    runs = defaultdict(list)
    for r in range(repeats):
        for name, path in models.items():
            print(f"[in memory] {name} repeat {r + 1}", file=sys.stderr, flush=True)
            cfg = child_config(
                BenchConfig(path, 0, ["1000x"], ["expert-cache"], prompts, tokens), "compute-only", "1000x"
            )
            result, err, rc = run_child(cfg, None)
            if result is None:
                raise SystemExit(f"{name} failed (exit {rc}): {err[-2000:]}")
            runs[name].append(summarize(result, None)["decode_tokens_per_s"])
    median = {name: statistics.median(v) for name, v in runs.items()}
    return {
        "decode_tokens_per_s_median": median,
        "runs": dict(runs),
        "ratio_to_bf16": {name: v / median["bf16"] for name, v in median.items()},
    }


def limited(models: dict[str, str], prompts, tokens: int, limit: int, caches: list[str], trace: str | None) -> dict:
    out = {}
    for name, path in models.items():
        config = BenchConfig(path, limit, caches, ["expert-cache"], prompts, tokens, routing_trace=trace, overlap=False)
        report = run_bench(config, progress=lambda m, n=name: print(f"[{n}] {m}", file=sys.stderr, flush=True))
        out[name] = {"reference": report["reference"], "runs": [{k: r.get(k) for k in KEEP} for r in report["runs"]]}
    for i in range(len(caches)):
        base = out["bf16"]["runs"][i]
        for name in models:
            run = out[name]["runs"][i]
            if "error" not in run and "error" not in base:
                run["tok_s_ratio_to_bf16"] = run["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                run["device_bytes_per_token_ratio_to_bf16"] = run["bytes_read_per_token"] / base["bytes_read_per_token"]
    return out


def small_limit(args, prompts) -> dict:
    config = BenchConfig(
        args.int4,
        parse_size(args.small_limit),
        [args.small_cache],
        ["expert-cache"],
        prompts,
        args.tokens,
        overlap=False,
        routing_trace=args.routing_trace,
    )
    report = run_bench(config, progress=lambda m: print(f"[small limit int4] {m}", file=sys.stderr, flush=True))
    out = {"weightstream_int4": [{k: r.get(k) for k in KEEP} for r in report["runs"]]}
    q4 = q4_gguf(args.model)
    if q4 is None:
        out["llamacpp_q4_k_m"] = {"skipped": "llama.cpp is not built here (no compiler or cmake)"}
        return out
    print("[small limit] llama.cpp Q4_K_M through mmap", file=sys.stderr, flush=True)
    out["llamacpp_q4_k_m"] = llamacpp.bench(
        q4,
        threads=args.threads,
        tokens=args.tokens,
        repeats=1,
        memory_limit=parse_size(args.small_limit),
        timeout=args.llama_timeout,
    )
    ours, theirs = out["weightstream_int4"][0].get("decode_tokens_per_s"), out["llamacpp_q4_k_m"]
    if ours and "decode_tokens_per_s" in theirs:
        out["ratio"] = ours / theirs["decode_tokens_per_s"]
    elif ours and "timeout_s" in theirs:  # llama.cpp produced fewer than `tokens` tokens in the whole time
        out["ratio_at_least"] = ours / (args.tokens / theirs["timeout_s"])
    return out


def q4_gguf(model_dir: str) -> str | None:
    if llamacpp.build() is None:
        return None
    bf16 = llamacpp.convert(model_dir, model_dir.rstrip("/") + ".bf16.gguf", "bf16")
    return llamacpp.quantize(bf16, model_dir.rstrip("/") + ".Q4_K_M.gguf", "Q4_K_M")


def llama_in_memory(args) -> dict:
    q4 = q4_gguf(args.model)
    if q4 is None:
        return {"skipped": "llama.cpp is not built here (no compiler or cmake)"}
    bf16 = args.model.rstrip("/") + ".bf16.gguf"
    return {
        name: llamacpp.bench(path, threads=args.threads, tokens=args.tokens, repeats=2)
        for name, path in (("bf16", bf16), ("Q4_K_M", q4))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the bf16 checkpoint")
    ap.add_argument("--int8", required=True, help="`weightstream quantize MODEL --bits 8` of it")
    ap.add_argument("--int4", required=True, help="`weightstream quantize MODEL --bits 4` of it")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--limit", default="5GiB")
    ap.add_argument("--equal-bytes", default="1.5GiB,3GiB")
    ap.add_argument("--small-limit", default="2GiB")
    ap.add_argument("--small-cache", default="1.5x", help="int4 expert cache under --small-limit")
    ap.add_argument("--llama-timeout", type=float, default=900)
    ap.add_argument("--routing-trace", help="replay this trace instead of the model's own routing")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp bf16 and Q4_K_M in memory")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: bytes,memory,limited,small")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    models = {"bf16": args.model, "int8": args.int8, "int4": args.int4}
    prompts = tokenized_prompts(args.model, None)[: args.prompts]
    report = {
        "machine": machine_info(block_device_of(args.model)),
        "command": sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "decode_tokens": args.tokens,
    }
    if "bytes" not in skip:
        report["expert_bytes"] = expert_bytes(models)
    if "memory" not in skip:
        report["in_memory"] = in_memory(models, prompts, args.tokens, args.repeats)
    if args.llamacpp:
        report["llamacpp_in_memory"] = llama_in_memory(args)
    if "limited" not in skip:
        report["limited"] = limited(
            models, prompts, args.tokens, parse_size(args.limit), args.equal_bytes.split(","), args.routing_trace
        )
    if "small" not in skip:
        report["small_limit"] = small_limit(args, prompts)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
