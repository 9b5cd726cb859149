"""Time to the first token of a long prompt under a memory limit, weightstream against llama.cpp on the same GGUF file,
back to back.

Each round runs, in alternating order, each in a fresh memory cgroup of --memory (counting the page cache) after
the file's pages are dropped:
- llama.cpp: `llama-bench -m FILE -p TOKENS -n 4 -r 1 --repack 0 -t THREADS` (mmap, its repacked path off: it
  would copy the weights into anonymous memory, and on MoE files it asserts); its prompt time is TOKENS / its
  prompt tokens a second (timed after llama-bench's own warm-up pass).
- weightstream: `weightstream bench IMPORTED --memory-limit SIZE --expert-cache memory --prefill-tokens TOKENS`
  on the file's import (the engine sizes its expert cache to the limit), --trace's routing replayed; its prompt
  time is the prefill of the TOKENS-token prompt, after the built-in prompts' decode has warmed the cache.
Medians and the spread of the rounds; the ratio is llama.cpp's time / ours (above 1: ours answers first). Needs
root (cgroups, page-cache drops).

    .venv/bin/python benchmarks/llamacpp.py prefill FILE.gguf IMPORTED_DIR --memory 2GiB --trace .work/ds.npz \\
        [--tokens 256] [--rounds 4] [--threads 2] [--out benchmarks/results/prefill-limit.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import llamacpp
from common.bench_runs import MIB, bench_caches
from common.results import default, emit
from common.rounds import against_llamacpp, alternated, head

from weightstream.units import parse_size


def say(msg: str) -> None:
    print(f"[prefill-limit] {msg}", file=sys.stderr, flush=True)


def ours(args) -> dict:
    run_args = SimpleNamespace(model=args.imported, memory=args.memory, trace=args.trace, max_new_tokens=4)
    got = bench_caches(run_args, ["memory"], extra=["--prefill-tokens", str(args.tokens)])["memory"]
    run = got["run"]
    if got["error"] or not run.get("long_prefill"):
        raise SystemExit(f"weightstream bench: {got['error'] or 'no prefill timed'}")
    prefill = run["long_prefill"]
    return {
        "prompt_s": prefill["prefill_s"],
        "io_wait_s": prefill["io_wait_s"],
        "mib_read": prefill["bytes_read"] / MIB,
        "expert_cache_mib": got["expert_cache_mib"],
        "cgroup_peak_mib": got["cgroup_peak_mib"],
    }


def llama(args) -> dict:
    got = llamacpp.bench(
        args.gguf,
        args.threads,
        4,
        repeats=1,
        memory_limit=parse_size(args.memory),
        timeout=3600,
        repack=False,
        prompt_tokens=args.tokens,
    )
    if "prompt_tokens_per_s" not in got:
        raise SystemExit(f"llama-bench: {got.get('error') or got.get('skipped')}")
    return {
        "prompt_s": args.tokens / got["prompt_tokens_per_s"],
        "cgroup_peak_mib": (got.get("cgroup_peak_bytes") or 0) / MIB,
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="llama.cpp's file")
    ap.add_argument("imported", help="`weightstream import` of it")
    ap.add_argument("--memory", required=True, help="the memory cgroup's limit, e.g. 2GiB")
    ap.add_argument("--trace", help="routing trace replayed on our side (from `weightstream trace import`)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=default("prefill-limit.json"))
    args = ap.parse_args(argv)
    runs = alternated(
        args.rounds,
        {"llama.cpp": lambda: llama(args), "weightstream": lambda: ours(args)},
        lambda r, who, got: say(f"round {r} {who}: {got['prompt_s']:.2f} s for {args.tokens} tokens"),
    )
    report = head(
        args.gguf,
        gguf_bytes=os.path.getsize(args.gguf),
        memory=args.memory,
        trace=os.path.basename(args.trace) if args.trace else None,
        tokens=args.tokens,
        threads=args.threads,
    )
    emit(against_llamacpp(report, runs, "prompt_s", "median_prompt_s", higher_is_better=False), args.out)
