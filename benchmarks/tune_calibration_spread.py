"""How far one `tune --calibrate` moves its own predictions: calibrations repeated back to back in one process.

A prediction can be no closer to a measurement than two calibrations of the same machine are to each other. This
loads the engine once, runs `bench.calibrate.Calibrator` --repeats times (as `tune --calibrate` does), fits each
(`sim.overlap_model.fit_cost_params`), and predicts the same configurations with each fit (`sim.tune.Search`, the
model's recorded routing): lru/slru/pinned at tune's three largest cache sizes and the page-cache path at the
budget. It prints the spread of every cost term and of every prediction (max/min - 1 over the repeats), which is
what a single calibration's minute adds to a proof's errors.

    PYTHONPATH=src .venv/bin/python benchmarks/tune_calibration_spread.py .work/bench-models/gpt-oss-4l-bf16 \\
        --memory 4GiB --repeats 5 --out docs/tune-calibration-spread-gptoss.json

Prints one JSON object (--out writes it too). The routing is the one `tune` saved next to the model (run `tune`
once first); without it the model's routing is recorded on the built-in prompts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from weightstream.bench.calibrate import Calibrator
from weightstream.bench.machine import block_device_of, machine_info
from weightstream.cache.expert_cache import ExpertCache
from weightstream.commands.tune_steps import TuneSession
from weightstream.sim.overlap_model import fit_cost_params
from weightstream.sim.tune import Search, cache_sizes
from weightstream.trace import load
from weightstream.units import parse_size

TERMS = ("dense_s", "expert_call_s", "read_latency_s", "read_s_per_mib", "nonoverlap_s_per_mib", "page_limit_s_per_mib")


def say(msg: str) -> None:
    print(f"[spread] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict:
    """median, min, max and max/min - 1 of positive figures (None where a figure was 0 or missing)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "spread": None}
    low, high = min(known), max(known)
    return {
        "median": statistics.median(known),
        "min": low,
        "max": high,
        "spread": high / low - 1 if low > 0 else None,
    }


def run(args) -> dict:
    session = TuneSession(args.model, parse_size(args.memory), args.context, args.io_threads)
    saved = session.store.parent / "routing-recorded.npz"
    if saved.exists():
        trace, routing = load(str(saved)), {"source": str(saved)}
    else:
        trace, routing = session.routing(None, None, 16)
    sizes = cache_sizes(session.facts, session.budget.expert_bytes)[-3:]
    model = session.engine(session.layout.working_set_bytes)
    calibrator = Calibrator(model, args.io_threads, None, progress=say)
    fits, raw, predictions, seconds = [], [], {}, []
    for r in range(args.repeats):
        say(f"calibration {r + 1} of {args.repeats}")
        if r:  # the last calibration closed its cache: start, as tune's does, from a 1x cache
            calibrator._use(ExpertCache(session.layout, session.layout.working_set_bytes, "lru", args.io_threads))
        start = time.perf_counter()
        measured, extra = calibrator.run()
        params = fit_cost_params(measured)
        seconds.append(time.perf_counter() - start)
        fits.append(params.to_dict())
        raw.append({"measurements": measured.to_dict(), "extra": extra})
        search = Search(trace, session.facts, params)
        configs = [search.expert_cache(policy, size) for policy in ("lru", "slru", "pinned") for size in sizes]
        if params.page_cache_s_per_mib is not None:
            configs.append(search.page_cache(session.budget.expert_bytes))
        for c in configs:
            name = f"{c.path} {c.policy} {c.cache_bytes / 2**30:.2f} GiB"
            predictions.setdefault(name, []).append(c.predicted_decode_tokens_per_s)
        say("  " + ", ".join(f"{k} {fits[-1][k]:.3g}" for k in TERMS if fits[-1].get(k) is not None))
    session.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    per_config = {name: {"tokens_per_s": v, **spread(v)} for name, v in predictions.items()}
    return {
        "machine": machine_info(block_device_of(args.model)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": commit,
        "command": " ".join(sys.argv),
        "model": args.model,
        "memory": args.memory,
        "routing": routing,
        "calibration_seconds": seconds,
        "terms": {k: spread([f.get(k) for f in fits]) for k in TERMS},
        "predictions": per_config,
        "largest_prediction_spread": max((c["spread"] or 0.0) for c in per_config.values()),
        "fits": fits,
        "calibrations": raw,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--memory", required=True, help="the memory limit tune sizes the expert budget for, e.g. 4GiB")
    p.add_argument("--repeats", type=int, default=5, help="calibrations, back to back")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args()
    if args.repeats < 2:
        p.error("--repeats: a spread needs at least 2 calibrations")
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
