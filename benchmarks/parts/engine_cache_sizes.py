"""Decode speed, hit rate and MiB read per token of the streaming engine at several cache sizes.

Baseline in the same run: transformers with every weight in memory (eager experts), when RAM allows.
Prints one JSON object and writes it to --out. Example:
    .venv/bin/python benchmarks/engine_bench.py cache-sizes --preset olmoe-1b-7b --layers 16 --tokens 32 \
        --out benchmarks/results/engine-cache-sizes-olmoe16.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time

import psutil
import torch
from common.results import default, emit
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize

PROMPT = "The quick brown fox jumps over the lazy dog. Streaming experts from a drive means deciding what to read"


def ensure_model(preset: str, layers: int, root: str) -> str:
    out = os.path.join(root, f"{preset}-{layers}l-bf16")
    if not os.path.exists(os.path.join(out, "config.json")):
        synthesize(out, preset_config(preset, layers=layers), "bf16", seed=0)
    return out


def in_memory(model_dir: str, ids: torch.Tensor, tokens: int) -> dict:
    size = open_checkpoint(model_dir).total_bytes()
    if psutil.virtual_memory().available < 1.5 * size:
        return {
            "skipped": f"needs {size / 2**30:.1f} GiB in memory; only "
            f"{psutil.virtual_memory().available / 2**30:.1f} GiB available"
        }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, experts_implementation="eager")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        first = model.generate(ids, max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        t2 = time.perf_counter()
    prefill = t1 - start
    return {
        "token_ids": out[0, ids.shape[1] :].tolist(),
        "prefill_s": prefill,
        "decode_tokens_per_s": (tokens - 1) / max(t2 - t1 - prefill, 1e-9),
        "first": first[0, -1].item(),
    }


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="olmoe-1b-7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sizes", default="1x,2x,4x")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--root", default=".work/bench-models")
    ap.add_argument("--out", default=default("engine-cache-sizes.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    model_dir = ensure_model(args.preset, args.layers, args.root)
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids])
    baseline = in_memory(model_dir, ids, args.tokens)
    gc.collect()  # the in-memory model must be gone before the streaming runs measure anything
    runs = []
    for size in args.sizes.split(","):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=args.io_threads)
        new, stats = generate(model, ids, args.tokens)
        model.weightstream.close()
        del model
        gc.collect()  # free this run's cache before the next one allocates its own
        run = {
            "expert_cache": size,
            **{
                k: stats.to_dict()[k]
                for k in (
                    "decode_tokens_per_s",
                    "prefill_s",
                    "expert_hit_rate",
                    "decode_expert_hit_rate",
                    "io_wait_s",
                    "expert_cache_bytes",
                    "working_set_bytes",
                )
            },
            "mib_read_per_token": stats.bytes_read_per_token / 2**20,
            "total_mib_read": stats.bytes_read / 2**20,
        }
        if "token_ids" in baseline:
            run["tokens_equal_in_memory"] = new[0].tolist() == baseline["token_ids"]
            run["decode_speed_vs_in_memory"] = stats.decode_tokens_per_s / baseline["decode_tokens_per_s"]
        runs.append(run)
    emit(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "model": model_dir,
            "expert_bytes_total": open_checkpoint(model_dir).total_bytes(),
            "prompt_tokens": ids.shape[1],
            "tokens": args.tokens,
            "in_memory": {k: v for k, v in baseline.items() if k != "token_ids"},
            "runs": runs,
        },
        args.out,
    )
