"""`tune`'s expert-cache predictions against decode measured in the same process, right after its calibration.

The tune proof (`tune_proof.py`) calibrates once per case and then measures for 20 minutes in fresh processes; on a
VM whose CPU and disk move by 20-40% within minutes (the proofs' calibrations priced a MiB read at 0.40-0.68 ms),
its errors mix the model's with the machine's drift. Here one process loads the engine, calibrates exactly as
`tune --calibrate` does (`bench.calibrate.Calibrator`), predicts every configuration with that calibration
(`sim.tune.Search`, the model's own recorded routing), and at once decodes the bench's prompts through an expert
cache of each configuration (natural routing, as the proof's own-routing runs), configuration after configuration;
then calibrates again and measures again (--rounds), each prediction against the decode of its own round.

Not measured here: the page-cache path (it needs a memory limit the process lives in) and the cgroup: this process
keeps every dense page resident, where a bench run at its limit may fault some back.

    PYTHONPATH=src .venv/bin/python benchmarks/tune_back_to_back.py .work/bench-models/gpt-oss-4l-bf16 \\
        --memory 4GiB --out docs/tune-back-to-back-gptoss.json

Prints one JSON object (--out writes it too). The model's routing is recorded first if tune has not saved one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from weightstream.bench.calibrate import Calibrator
from weightstream.bench.machine import block_device_of, machine_info
from weightstream.cache.expert_cache import ExpertCache
from weightstream.commands.tune_steps import TuneSession
from weightstream.engine.generate import generate
from weightstream.engine.prompts import tokenized_prompts
from weightstream.sim.overlap_model import fit_cost_params
from weightstream.sim.replay import pinned_set
from weightstream.sim.tune import Search, cache_sizes
from weightstream.trace import load
from weightstream.units import MIB, parse_size


def say(msg: str) -> None:
    print(f"[back-to-back] {msg}", file=sys.stderr, flush=True)


def three_sizes(sizes: list[int]) -> list[int]:
    """The three largest of tune's cache sizes (the budget and the two below it: where recommendations fall)."""
    return sizes[-3:]


def decode(model, prompts: list[list[int]], tokens: int) -> dict:
    """The bench's decode: each prompt, `tokens` new tokens; tok/s and MiB read per token over all decode steps."""
    steps = seconds = read = 0.0
    for ids in prompts:
        new, stats = generate(model, torch.tensor([ids]), tokens)
        n = new.shape[1] - 1  # decode steps: every token after the prefill's
        steps += n
        seconds += n / stats.decode_tokens_per_s if stats.decode_tokens_per_s else 0.0
        read += stats.bytes_read_per_token * n
    return {"decode_tokens_per_s": steps / seconds, "mib_read_per_token": read / steps / MIB}


def run(args) -> dict:
    session = TuneSession(args.model, parse_size(args.memory), args.context, args.io_threads)
    saved = session.store.parent / "routing-recorded.npz"
    if saved.exists():
        trace, routing = load(str(saved)), {"source": str(saved)}
    else:
        trace, routing = session.routing(None, None, args.tokens)
    prompts = tokenized_prompts(args.model, None)
    sizes = three_sizes(cache_sizes(session.facts, session.budget.expert_bytes))
    model = session.engine(session.layout.working_set_bytes)
    calibrator = Calibrator(model, args.io_threads, None, progress=say)
    rounds = []
    for r in range(args.rounds):
        say(f"round {r + 1} of {args.rounds}: calibrating")
        start = time.perf_counter()
        if r:  # the last configuration's cache is closed: calibration starts, as tune's does, from a 1x cache
            calibrator._use(ExpertCache(session.layout, session.layout.working_set_bytes, "lru", args.io_threads))
        measurements, _ = calibrator.run()
        params = fit_cost_params(measurements)
        search = Search(trace, session.facts, params)
        configs = []
        for policy in args.policies.split(","):
            for size in sizes:
                predicted = search.expert_cache(policy, size)
                options = None
                if policy == "pinned":
                    options = {"pinned_keys": [tuple(k) for k in pinned_set(search.w, predicted.slots, search.options)]}
                say(f"round {r + 1}: {policy} {size / 2**30:.2f} GiB")
                calibrator._use(
                    ExpertCache(session.layout, size, policy, args.io_threads, None, policy_options=options)
                )
                model.weightstream.routing_override = None  # the prompts' own routing, as tune recorded it
                try:
                    measured = decode(model, prompts, args.tokens)
                finally:
                    model.weightstream.cache.close()
                error = predicted.predicted_decode_tokens_per_s / measured["decode_tokens_per_s"] - 1
                configs.append(
                    {
                        "policy": policy,
                        "cache_bytes": size,
                        "predicted_decode_tokens_per_s": predicted.predicted_decode_tokens_per_s,
                        "predicted_mib_read_per_token": predicted.mib_read_per_token,
                        **{f"measured_{k}": v for k, v in measured.items()},
                        "error": error,
                    }
                )
                say(
                    f"  predicted {predicted.predicted_decode_tokens_per_s:.2f}, measured "
                    f"{measured['decode_tokens_per_s']:.2f} tok/s ({error:+.0%})"
                )
        rounds.append({"params": params.to_dict(), "configs": configs, "seconds": time.perf_counter() - start})
    session.close()
    errors = [c["error"] for rnd in rounds for c in rnd["configs"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "machine": machine_info(block_device_of(args.model)),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": commit,
        "command": " ".join(sys.argv),
        "model": args.model,
        "memory": args.memory,
        "routing": routing,
        "rounds": rounds,
        "summary": {
            "configurations": len(errors),
            "within_15_percent": sum(abs(e) <= 0.15 for e in errors),
            "error_min": min(errors),
            "error_max": max(errors),
            "error_median": sorted(errors)[len(errors) // 2],
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--memory", required=True, help="the memory limit tune sizes the expert budget for, e.g. 4GiB")
    p.add_argument("--policies", default="lru,slru,pinned")
    p.add_argument("--rounds", type=int, default=2, help="calibrate-then-measure rounds")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per prompt, as the proof's bench runs")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
