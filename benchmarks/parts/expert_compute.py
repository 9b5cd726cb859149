"""Expert compute against transformers' eager in memory and llama.cpp, with every expert resident; then under a
memory limit, the lean kernel against the one-expert-eager path it replaces.

1. compute-only: each configuration in its own process, no memory limit, every expert read into the cache before
   the clock starts: transformers eager (the reference), the engine with the lean kernel (auto), the engine with
   one-expert-eager (the previous path). Repeats interleaved; medians of ms per decode token; tokens compared.
2. llama.cpp on the same weights converted to a bf16 GGUF, in memory (`--llamacpp`; built once, see llamacpp.py).
3. under --memory-limit at --caches, `weightstream bench` expert-cache runs with each kernel (cold, own cgroup).
4. `--profile`: where the time of one decode token goes, by torch op, for eager and both engine kernels.

    .venv/bin/python benchmarks/engine_bench.py compute .work/bench-models/olmoe-16l-bf16 --llamacpp \\
        --memory-limit 5GiB --caches 1x,2x --profile --out benchmarks/results/expert-compute-olmoe16.json

Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import llamacpp
from common.results import default, emit

from weightstream.bench.machine import block_device_of, machine_info
from weightstream.bench.prompts import tokenized_prompts
from weightstream.bench.runner import BenchConfig, child_config, run_bench, run_child, summarize
from weightstream.units import parse_size

# `--profile` runs each configuration in a process of its own through the entry point this part runs under:
# `engine_bench.py compute --profile-child MODE MODEL --tokens N`
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine_bench.py")

KERNELS = ("auto", "one-expert-eager")
CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_weight_int"),
    "elementwise": (
        "aten::mul",
        "aten::silu",
        "aten::add",
        "aten::sigmoid",
        "aten::clamp",
        "aten::gelu",
        "aten::to",
        "aten::_to_copy",
        "aten::copy_",
        "aten::pow",
        "aten::rsqrt",
        "aten::mean",
    ),
    "routing and indexing": (
        "aten::index",
        "aten::where",
        "aten::nonzero",
        "aten::one_hot",
        "aten::argsort",
        "aten::sort",
        "aten::unique",
        "aten::topk",
        "aten::softmax",
        "aten::eq",
        "aten::gt",
        "aten::sum",
        "aten::permute",
        "aten::item",
        "aten::_local_scalar",
        "aten::remainder",
    ),
    "accumulation": ("aten::index_add_", "aten::zeros", "aten::zero_", "aten::fill_"),
}


def compute_only(args, prompts) -> dict:
    base = BenchConfig(args.model, 0, ["1000x"], ["expert-cache"], prompts, args.tokens, reference=False)
    configs = {"transformers-eager": child_config(base, "in-memory", "")}
    for kernel in KERNELS:
        configs[f"engine-{kernel}"] = {**child_config(base, "compute-only", "1000x"), "expert_kernel": kernel}
    runs = defaultdict(list)
    tokens = {}
    for r in range(args.repeats):
        for name, cfg in configs.items():
            print(f"[compute] {name} repeat {r + 1}", file=sys.stderr, flush=True)
            result, err, rc = run_child(cfg, None)
            if result is None:
                raise SystemExit(f"{name} failed (exit {rc}): {err[-2000:]}")
            runs[name].append(1000 / summarize(result, None)["decode_tokens_per_s"])
            tokens.setdefault(name, [p["token_ids"] for p in result["prompts"]])
    ms = {name: statistics.median(v) for name, v in runs.items()}
    eager = ms["transformers-eager"]
    return {
        "ms_per_token_median": ms,
        "ms_per_token_runs": dict(runs),
        "ratio_to_eager": {name: v / eager for name, v in ms.items()},
        "tokens_equal_to_eager": {name: t == tokens["transformers-eager"] for name, t in tokens.items()},
    }


def llama(args) -> dict:
    if llamacpp.build() is None:
        return {"skipped": "no compiler or cmake: llama.cpp not built"}
    gguf = llamacpp.convert(args.model, args.model.rstrip("/") + ".bf16.gguf", "bf16")
    return llamacpp.bench(gguf, threads=args.threads, tokens=args.tokens, repeats=args.repeats)


def limited(args, prompts) -> dict:
    """Each kernel at each cache size under the limit, repeats interleaved; medians and the lean/old ratio."""
    runs = {k: defaultdict(list) for k in KERNELS}
    tokens = {}
    for r in range(args.limited_repeats):
        for kernel in KERNELS:
            config = BenchConfig(
                args.model,
                parse_size(args.memory_limit),
                args.caches.split(","),
                ["expert-cache"],
                prompts,
                args.tokens,
                reference=False,
                overlap=False,
                expert_kernel=kernel,
            )
            say = lambda m, k=kernel, r=r: print(f"[limited {k} repeat {r + 1}] {m}", file=sys.stderr, flush=True)
            for run in run_bench(config, progress=say)["runs"]:
                if "error" in run:
                    raise SystemExit(f"{kernel} {run['expert_cache']}: {run['error']}")
                runs[kernel][run["expert_cache"]].append({k: run.get(k) for k in LIMITED_KEEP})
                tokens.setdefault((kernel, run["expert_cache"]), run["token_ids"])
    out = {}
    for cache in args.caches.split(","):
        med = {k: statistics.median(x["decode_tokens_per_s"] for x in runs[k][cache]) for k in KERNELS}
        out[cache] = {
            "decode_tokens_per_s_median": med,
            "runs": {k: runs[k][cache] for k in KERNELS},
            "ms_per_token_median": {k: 1000 / v for k, v in med.items()},
            "lean_over_one_expert_eager": med["auto"] / med["one-expert-eager"],
            "tokens_equal": tokens[("auto", cache)] == tokens[("one-expert-eager", cache)],
        }
    return out


LIMITED_KEEP = (
    "decode_tokens_per_s",
    "expert_hit_rate",
    "decode_bytes_read_per_token",
    "io_wait_s",
    "cgroup_peak_bytes",
)


def profile(args) -> dict:
    out = {}
    for mode in ("transformers-eager", *[f"engine-{k}" for k in KERNELS]):
        print(f"[profile] {mode}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [
                sys.executable,
                ENTRY,
                "compute",
                "--profile-child",
                mode,
                args.model,
                "--tokens",
                str(args.profile_tokens),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"profile {mode} failed: {done.stderr[-2000:]}")
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def profile_child(mode: str, model_dir: str, tokens: int) -> None:
    """One process: load, warm, then torch.profiler over `tokens` decode steps (a generation of tokens + 1 less one
    of 1, so the prefill is not counted); per-token self time and calls by op."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AutoModelForCausalLM

    from weightstream.bench.child import warm_every_expert
    from weightstream.engine.loader import load_streaming_model

    if mode == "transformers-eager":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", experts_implementation="eager")
    else:
        model = load_streaming_model(model_dir, expert_cache="1000x", expert_kernel=mode.removeprefix("engine-"))
        warm_every_expert(model.weightstream.cache)
    ids = torch.tensor([tokenized_prompts(model_dir, None)[0]])

    def profiled(new_tokens: int) -> tuple[dict, dict, float]:
        """Self ms and calls by op, and wall seconds, of one greedy generation of exactly `new_tokens` tokens."""
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = _timed(
                lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            )
        events = prof.key_averages()
        return {e.key: e.self_cpu_time_total / 1000 for e in events}, {e.key: e.count for e in events}, wall

    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        # decode only: a generation of tokens + 1 minus one of 1 (the prefill and its first token)
        ms_one, calls_one, wall_one = profiled(1)
        ms_all, calls_all, wall_all = profiled(tokens + 1)
    ops = set(ms_one) | set(ms_all)
    per_op = {op: (ms_all.get(op, 0) - ms_one.get(op, 0)) / tokens for op in ops}  # ms per decode token
    calls = {op: (calls_all.get(op, 0) - calls_one.get(op, 0)) / tokens for op in ops}
    wall = wall_all - wall_one
    categories, category_calls = defaultdict(float), defaultdict(float)
    for op, ms in per_op.items():
        cat = next((c for c, prefixes in CATEGORIES.items() if op.startswith(prefixes)), "other ops")
        categories[cat] += ms
        category_calls[cat] += calls[op]
    total = sum(per_op.values())
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:15]
    # The profiler's self times include its own overhead and the intra-op threads' work, so they do not add up to
    # the wall time: shares and call counts compare configurations; the (profiled) wall time is given apart.
    report = {
        "ms_per_token_wall_profiled": wall * 1000 / tokens,
        "op_calls_per_token": sum(calls.values()),
        "share_of_op_time": {c: ms / total for c, ms in categories.items()},
        "calls_per_token_by_category": dict(category_calls),
        "top_ops_share": {op: ms / total for op, ms in top},
        "top_ops_calls_per_token": {op: calls[op] for op, _ in top},
    }
    print(json.dumps(report))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-child"]:  # --profile-child MODE MODEL --tokens N
        profile_child(argv[1], argv[2], int(argv[4]))
        return
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory, e.g. a `weightstream synth --preset olmoe-1b-7b` checkpoint")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per prompt (default 32)")
    ap.add_argument("--prompts", type=int, default=2, help="built-in prompts to run (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each configuration (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2: this machine's cores)")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp on a bf16 GGUF of the model")
    ap.add_argument("--memory-limit", help="also run each kernel under this memory limit (needs root)")
    ap.add_argument("--caches", default="1x,2x", help="expert caches for the limited runs (default 1x,2x)")
    ap.add_argument("--limited-repeats", type=int, default=3, help="interleaved repeats of the limited runs")
    ap.add_argument("--profile", action="store_true", help="also profile one decode token by torch op")
    ap.add_argument("--profile-tokens", type=int, default=8)
    ap.add_argument("--skip-compute-only", action="store_true")
    ap.add_argument("--out", default=default("expert-compute.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    prompts = tokenized_prompts(args.model, None)[: args.prompts]
    report = {
        "machine": machine_info(block_device_of(args.model)),
        "model": args.model,
        "command": sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "decode_tokens": args.tokens,
    }
    if not args.skip_compute_only:
        report["compute_only"] = compute_only(args, prompts)
    if args.llamacpp:
        report["llamacpp_bf16_in_memory"] = llama(args)
    if args.memory_limit:
        report["limited"] = limited(args, prompts)
    if args.profile:
        report["profile"] = profile(args)
    emit(report, args.out)
