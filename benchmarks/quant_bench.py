"""Quantized experts end to end, bf16 beside int8 and int4 of the same weights, against llama.cpp where it runs.

1. bytes: one expert's bytes in each format (scales included), as ratios to bf16.
2. in memory: decode with every expert resident (own process, no limit, repeats interleaved), per format.
3. under --limit (default 5 GiB) with expert caches of equal bytes (--equal-bytes, default bf16's working set,
   1.50 GiB here, then 3 GiB): decode tok/s and device bytes read per token of each format, median of
   --limited-repeats; tokens against each format's own in-memory reference.
4. under --small-limit (default 2 GiB, below the int4 model's size): weightstream int4 at --small-cache against
   llama.cpp Q4_K_M of the same weights through mmap (GGUF made by llama.cpp's converter and quantizer, run time
   capped at --llama-timeout; a timeout is reported as such), both as llama.cpp runs by default (it repacks
   Q4_K into anonymous memory at load) and with `--repack 0` (weights stay in the mapped file).
   `--llamacpp` also times llama.cpp in memory.

    .venv/bin/python benchmarks/quant_bench.py .work/bench-models/olmoe-16l-bf16 \\
        --int8 .work/bench-models/olmoe-16l-int8 --int4 .work/bench-models/olmoe-16l-int4 --llamacpp \\
        --out benchmarks/results/quant-bench-olmoe16.json

Prints one JSON object and writes it to --out. One part runs by name instead:

    quality    held-out perplexity of bf16, int8 and int4, experts alone and with dense weights quantized, on a
               small MoE trained here, qwen3_moe or olmoe (parts/quant_quality.py):
               .venv/bin/python benchmarks/quant_bench.py quality --help

Which kernel computes one quantized projection fastest is `kernel_bench.py routes`.
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
from common import run_part  # noqa: E402
from common.results import default, save  # noqa: E402

from weightstream.bench.machine import block_device_of, machine_info  # noqa: E402
from weightstream.bench.prompts import tokenized_prompts  # noqa: E402
from weightstream.bench.runner import BenchConfig, child_config, run_bench, run_child, summarize  # noqa: E402
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
    mapped = {name: map_model(path) for name, path in models.items()}
    sizes = {name: next(iter(m.layout.experts.values())).nbytes for name, m in mapped.items()}
    formats = {
        name: {
            "experts": m.quant.scheme if m.quant else str(m.model.dtype).removeprefix("torch."),
            "dense_quantized": sorted({t for t, _ in (m.quant.dense or {}).values()}) if m.quant else [],
            "dense_bytes": sum(t.nbytes for t in m.layout.dense.values()),
        }
        for name, m in mapped.items()
    }
    return {"bytes": sizes, "ratio_to_bf16": {name: b / sizes["bf16"] for name, b in sizes.items()}, "formats": formats}


def in_memory(models: dict[str, str], prompts, tokens: int, repeats: int, ggufs=None, threads: int = 2) -> dict:
    """Decode tok/s with every expert resident, each model in its own process; llama.cpp's runs of `ggufs`
    (name -> file) interleaved with ours in every repeat, so each ratio is measured back to back."""
    runs = defaultdict(list)
    llama = defaultdict(list)
    for r in range(repeats):
        for name, path in (ggufs or {}).items():
            print(f"[in memory] llama.cpp {name} repeat {r + 1}", file=sys.stderr, flush=True)
            result = llamacpp.bench(path, threads=threads, tokens=tokens, repeats=1)
            llama[name].append(result.get("decode_tokens_per_s"))
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
    out = {
        "decode_tokens_per_s_median": median,
        "runs": dict(runs),
        "ratio_to_bf16": {name: v / median["bf16"] for name, v in median.items()},
    }
    if llama:
        theirs = {name: statistics.median(v) for name, v in llama.items() if None not in v}
        out["llamacpp"] = {"decode_tokens_per_s_median": theirs, "runs": dict(llama)}
        out["ratio_to_llamacpp"] = {name: {g: v / t for g, t in theirs.items()} for name, v in median.items()}
    return out


def equal_bytes(spec: str, bf16_model: str) -> list[str]:
    """--equal-bytes entries as byte sizes every format gets; `bf16-1x` is bf16's own working set (its smallest
    cache, a hair over 1.5 GiB on the 16-layer OLMoE shape)."""
    ws = map_model(bf16_model).layout.working_set_bytes
    return [str(ws) if s.strip() == "bf16-1x" else s.strip() for s in spec.split(",")]


def limited(
    models: dict[str, str], prompts, tokens: int, limit: int, caches: list[str], trace: str | None, repeats: int
) -> dict:
    """Each format at each cache `repeats` times (formats interleaved, tokens checked on the first pass);
    the median run of each (format, cache) is kept, with every run's tok/s beside it."""
    passes = defaultdict(list)
    for r in range(repeats):
        for name, path in models.items():
            config = BenchConfig(
                path,
                limit,
                caches,
                ["expert-cache"],
                prompts,
                tokens,
                routing_trace=trace,
                overlap=False,
                reference=(r == 0),
            )
            report = run_bench(
                config, progress=lambda m, n=name, r=r: print(f"[{n} pass {r + 1}] {m}", file=sys.stderr, flush=True)
            )
            passes[name].append(report)
    out = {}
    for name, reports in passes.items():
        runs = []
        for i in range(len(caches)):
            tries = [rep["runs"][i] for rep in reports]
            ok = [t for t in tries if t.get("error") is None]
            if not ok:
                runs.append({k: tries[0].get(k) for k in KEEP})
                continue
            ok.sort(key=lambda t: t["decode_tokens_per_s"])
            run = {k: ok[len(ok) // 2].get(k) for k in KEEP}
            run["token_ids_equal_to_reference"] = tries[0].get("token_ids_equal_to_reference")
            run["decode_tokens_per_s_runs"] = [t.get("decode_tokens_per_s") for t in tries]
            runs.append(run)
        out[name] = {"reference": reports[0]["reference"], "runs": runs}
    for i in range(len(caches)):
        base = out["bf16"]["runs"][i]
        for name in models:
            run = out[name]["runs"][i]
            if run.get("error") is None and base.get("error") is None:
                run["tok_s_ratio_to_bf16"] = run["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                run["decode_device_bytes_per_token_ratio_to_bf16"] = (
                    run["decode_bytes_read_per_token"] / base["decode_bytes_read_per_token"]
                )
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
    for key, repack in (("llamacpp_q4_k_m", True), ("llamacpp_q4_k_m_no_repack", False)):
        print(f"[small limit] llama.cpp Q4_K_M through mmap, repack {int(repack)}", file=sys.stderr, flush=True)
        out[key] = llamacpp.bench(
            q4,
            threads=args.threads,
            tokens=args.tokens,
            repeats=1,
            memory_limit=parse_size(args.small_limit),
            timeout=args.llama_timeout,
            repack=repack,
        )
    ours = out["weightstream_int4"][0].get("decode_tokens_per_s")
    for key in ("llamacpp_q4_k_m", "llamacpp_q4_k_m_no_repack"):
        theirs = out[key]
        if ours and "decode_tokens_per_s" in theirs:
            theirs["weightstream_ratio"] = ours / theirs["decode_tokens_per_s"]
        elif ours and "timeout_s" in theirs:  # fewer than `tokens` tokens in the whole time: a bound
            theirs["weightstream_ratio_at_least"] = ours / (args.tokens / theirs["timeout_s"])
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
    if run_part("quant_bench.py", {"quality": "quant_quality"}):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the bf16 checkpoint")
    ap.add_argument("--int8", required=True, help="`weightstream quantize MODEL --bits 8` of it")
    ap.add_argument("--int4", required=True, help="`weightstream quantize MODEL --bits 4` of it")
    # the format of each directory is its manifest's: the scheme and kernels are reported beside each figure
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another quantization of the same weights for the bytes and in-memory parts (repeatable), e.g. "
        "torch-int4=MODEL-t4 (--kernel torch) or q4k-dense-int4=MODEL-d4 (--dense int4)",
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--limit", default="5GiB")
    ap.add_argument(
        "--equal-bytes",
        default="bf16-1x,3GiB",
        help="expert caches every format gets, in bytes; bf16-1x is bf16's working set (its smallest cache)",
    )
    ap.add_argument("--limited-repeats", type=int, default=3)
    ap.add_argument("--small-limit", default="2GiB")
    ap.add_argument("--small-cache", default="1.5x", help="int4 expert cache under --small-limit")
    ap.add_argument("--llama-timeout", type=float, default=900)
    ap.add_argument("--routing-trace", help="replay this trace instead of the model's own routing")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp bf16 and Q4_K_M in memory")
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a GGUF of the same weights that llama.cpp decodes in memory, interleaved with our in-memory runs in "
        "every repeat (repeatable), e.g. Q4_K_M=MODEL.Q4_K_M.gguf; every model's ratio to each is reported",
    )
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: bytes,memory,limited,small")
    ap.add_argument("--out", default=default("quant-bench.json"), help="result file (default: %(default)s)")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    models = {"bf16": args.model, "int8": args.int8, "int4": args.int4}
    for spec in args.also:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.isdir(path):
            raise SystemExit(f"--also {spec!r}: give NAME=DIR with an existing model directory")
        models[name] = path
    limited_models = {k: models[k] for k in ("bf16", "int8", "int4")}
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
        ggufs = {}
        for spec in args.gguf:
            name, sep, path = spec.partition("=")
            if not sep or not name or not os.path.isfile(path):
                raise SystemExit(f"--gguf {spec!r}: give NAME=FILE with an existing GGUF file")
            ggufs[name] = path
        report["in_memory"] = in_memory(models, prompts, args.tokens, args.repeats, ggufs, args.threads)
    if args.llamacpp:
        report["llamacpp_in_memory"] = llama_in_memory(args)
    if "limited" not in skip:
        report["limited"] = limited(
            limited_models,
            prompts,
            args.tokens,
            parse_size(args.limit),
            equal_bytes(args.equal_bytes, args.model),
            args.routing_trace,
            args.limited_repeats,
        )
    if "small" not in skip:
        report["small_limit"] = small_limit(args, prompts)
    text = json.dumps(report, indent=1)
    print(text)
    save(text, args.out)


if __name__ == "__main__":
    main()
