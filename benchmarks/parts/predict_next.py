"""Next-layer expert prediction on vs off, side by side in one run: accuracy, bytes read, I/O wait, decode tok/s.

Each configuration runs in its own process (`weightstream.bench.child`, the one `weightstream bench`
uses) after the model's files are dropped from the page cache (fadvise, these files only). Configurations are
interleaved and repeated so that load from other work on the machine shows up as spread, not as a trend.
Ratios compare prediction on with prediction off at the same cache size and routing, within the same repeat.
Prints one JSON object and writes it to --out. Example:
    .venv/bin/python benchmarks/engine_bench.py predict-next --model .work/olmoe-4l --trace .work/ds.npz
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import psutil
from common.results import default, save

from weightstream.bench.prompts import BUILTIN_PROMPTS
from weightstream.bench.runner import BenchConfig, child_config, run_child
from weightstream.engine.loader import load_tokenizer
from weightstream.io.pagecache import evict_file
from weightstream.store.checkpoint import open_checkpoint

MIB = 2**20
FIGURES = (
    "decode_tokens_per_s",
    "mib_read_per_token",
    "decode_io_wait_s_per_token",
    "decode_hit_rate",
    "decode_prediction_accuracy",
    "readahead_issued",
    "readahead_used",
    "readahead_wasted",
)


def drop_files(paths: list[str]) -> None:
    """Evict only this model's pages: a system-wide drop would disturb other work on a shared machine."""
    for path in paths:
        evict_file(path)


def one_run(config: BenchConfig, cache: str, files: list[str]) -> dict:
    drop_files(files)
    result, err, rc = run_child(child_config(config, "expert-cache", cache), None)
    if result is None:
        raise SystemExit(f"run failed (exit {rc}): {err.strip()[-2000:]}")
    return figures(result["prompts"])


def figures(prompts: list[dict]) -> dict:
    """Decode-only figures summed over the prompts (prefill reads most experts once and would drown them)."""
    steps = sum(p["generated_tokens"] - 1 for p in prompts)
    lookups = sum(p["expert_hits"] + p["expert_misses"] for p in prompts)
    return {
        "decode_tokens_per_s": steps / sum(p["decode_s"] for p in prompts),
        "mib_read_per_token": sum(p["bytes_read"] - p["prefill_bytes_read"] for p in prompts) / steps / MIB,
        "decode_io_wait_s_per_token": sum(p["decode_io_wait_s"] for p in prompts) / steps,
        "decode_hit_rate": statistics.fmean(p["decode_expert_hit_rate"] for p in prompts),
        "decode_prediction_accuracy": statistics.fmean(p["decode_prediction_accuracy"] for p in prompts),
        "readahead_issued": sum(p["readahead_issued"] for p in prompts),
        "readahead_used": sum(p["readahead_used"] for p in prompts),
        "readahead_wasted": sum(p["readahead_wasted"] for p in prompts),
        "expert_lookups": lookups,
        "decode_steps": steps,
        "token_ids": [p["token_ids"] for p in prompts],
    }


def reference_tokens(config: BenchConfig, model_bytes: int) -> list | None:
    """transformers with every weight in memory (eager experts), when the machine has room for it."""
    if psutil.virtual_memory().available < 2 * model_bytes:
        return None
    result, _, _ = run_child(child_config(config, "in-memory", ""), None)
    return [p["token_ids"] for p in result["prompts"]] if result is not None else None


def summarize(runs: list[dict]) -> list[dict]:
    """Per (routing, cache): median of each figure off and on, and the median of per-repeat on/off ratios."""
    out = []
    for routing, cache in dict.fromkeys((r["routing"], r["cache"]) for r in runs):
        pairs = [
            (off, on)
            for off in runs
            for on in runs
            if off["routing"] == on["routing"] == routing
            and off["cache"] == on["cache"] == cache
            and off["repeat"] == on["repeat"]
            and not off["predict_next"]
            and on["predict_next"]
        ]
        row = {"routing": routing, "cache": cache, "repeats": len(pairs)}
        for name in FIGURES:
            row[f"{name}_off"] = statistics.median(off[name] for off, _ in pairs)
            row[f"{name}_on"] = statistics.median(on[name] for _, on in pairs)
        for name in ("decode_tokens_per_s", "mib_read_per_token", "decode_io_wait_s_per_token"):
            ratios = [on[name] / off[name] for off, on in pairs if off[name]]
            row[f"{name}_ratio_on_vs_off"] = statistics.median(ratios) if ratios else None
            row[f"{name}_ratio_spread"] = [min(ratios), max(ratios)] if ratios else None
        row["tokens_equal_on_vs_off"] = all(off["token_ids"] == on["token_ids"] for off, on in pairs)
        out.append(row)
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".work/olmoe-4l")
    ap.add_argument("--trace", default=".work/ds.npz", help="routing trace to replay as a second workload ('' skips)")
    ap.add_argument("--caches", default="1x,2x")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="how many built-in prompts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--out", default=default("engine-predict-next.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.model, required=True)
    prompts = [tokenizer(t).input_ids for t in BUILTIN_PROMPTS[: args.prompts]]
    files = open_checkpoint(args.model).files
    routings = [("own", None)] + ([("replay", os.path.abspath(args.trace))] if args.trace else [])
    model_bytes = open_checkpoint(args.model).total_bytes()
    print("[predict_next] reference: transformers in memory", file=sys.stderr)
    reference = reference_tokens(BenchConfig(args.model, 0, [], ["expert-cache"], prompts, args.tokens), model_bytes)
    runs, start = [], time.time()
    for repeat in range(args.repeats):
        for routing, trace in routings:
            for cache in args.caches.split(","):
                for predict in (False, True):
                    config = BenchConfig(
                        args.model,
                        0,
                        [cache],
                        ["expert-cache"],
                        prompts,
                        args.tokens,
                        routing_trace=trace,
                        io_threads=args.io_threads,
                        predict_next=predict,
                    )
                    print(f"[predict_next] repeat {repeat} {routing} {cache} predict={predict}", file=sys.stderr)
                    runs.append(
                        {
                            "repeat": repeat,
                            "routing": routing,
                            "cache": cache,
                            "predict_next": predict,
                            **one_run(config, cache, files),
                        }
                    )
    text = json.dumps(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "memory_bytes": psutil.virtual_memory().total,
                "kernel": platform.release(),
                "python": platform.python_version(),
                "load_avg_at_end": os.getloadavg(),
            },
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d"),
            "wall_s": time.time() - start,
            "model": args.model,
            "model_bytes": model_bytes,
            "trace": args.trace,
            "prompts": len(prompts),
            "new_tokens": args.tokens,
            "io_threads": args.io_threads,
            "reference": "transformers in memory" if reference else "none (not enough free memory)",
            "own_routing_tokens_equal_reference": [r["token_ids"] == reference for r in runs if r["routing"] == "own"]
            if reference
            else None,
            "summary": summarize(runs),
            "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
        }
    )
    print(text)
    save(text, args.out)
