"""Both page-cache models of `tune` on each case of `tune_proof.py` reports, against the measured page-cache rows.

Each case's stored calibration and routing go through `Search.page_cache` twice: with the checkpoint's byte ranges
(the kernel's two lists, `sim.page_cache_model`) and without them (LRU over whole experts, room / readahead).
Run from the repository root after the proof, which leaves its replay traces in .work/tune-proof:

    PYTHONPATH=src .venv/bin/python benchmarks/tune_page_cache_models.py docs/tune-proof-olmoe-evening.json ...

Prints one Markdown row per case: measured tok/s, then each model's prediction (error; fault-free share, MiB read
per token). `--measure-reads` first runs the page-cache path of each case once more under `bench` (its limit, the
proof's prompts and routing, 16 tokens) and adds the MiB the kernel read per decode token for this process
(/proc/self/io), so that a model's read count is checked apart from its price per MiB. Needs root (the cgroup).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from weightstream.bench.runner import BenchConfig, run_bench
from weightstream.commands.tune_steps import TuneSession
from weightstream.engine.prompts import tokenized_prompts
from weightstream.sim.overlap_model import CostParams
from weightstream.sim.tune import Search
from weightstream.units import MIB, parse_size


def routing_file(case: dict) -> str:
    model = Path(case["model"])
    if case["routing"] == "own":
        return str(model / ".weightstream" / "routing-recorded.npz")
    return f".work/tune-proof/{model.name}-{case['routing']}-16.npz"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+")
    p.add_argument("--measure-reads", action="store_true", help="bench each case's page-cache path for its reads")
    args = p.parse_args()
    for path in args.reports:
        with open(path) as f:
            cases = [c for c in json.load(f)["cases"] if "error" not in c]
        for c in cases:
            measured = next(g for g in c["grid"] if g["path"] == "page-cache")["measured"]
            session = TuneSession(c["model"], parse_size(c["limit"]), 512, 4)
            trace, _ = session.routing(routing_file(c), None, 16)
            params = CostParams.from_dict(c["calibration"])
            cells = []
            for facts in (session.facts, dataclasses.replace(session.facts, spans=None)):
                cfg = Search(trace, facts, params).page_cache(session.budget.expert_bytes)
                tok_s = cfg.predicted_decode_tokens_per_s
                cells.append(
                    f"{tok_s:.2f} ({tok_s / measured - 1:+.0%}; hit {cfg.hit_rate:.2f}, "
                    f"{cfg.mib_read_per_token:.0f} MiB/token)"
                )
            if args.measure_reads:
                tok_s, mib = measure_reads(c)
                measured_cell = f"{measured:.2f}; again {tok_s:.2f}, {mib:.0f} MiB/token"
            else:
                measured_cell = f"{measured:.2f}"
            print(
                f"| {Path(c['model']).name} {c['limit']} {c['routing']} | {measured_cell} | " + " | ".join(cells) + " |"
            )


def measure_reads(case: dict) -> tuple[float, float]:
    """(decode tok/s, MiB read per decode token) of one more page-cache run of the case under `bench`."""
    routing = None if case["routing"] == "own" else routing_file(case)
    config = BenchConfig(
        model_dir=case["model"],
        memory_limit=parse_size(case["limit"]),
        expert_caches=["0"],  # unused by the page-cache path
        modes=["page-cache"],
        prompts=tokenized_prompts(case["model"], None),
        max_new_tokens=16,
        routing_trace=routing,
        reference=False,
        overlap=False,
    )
    run = run_bench(config, progress=lambda m: None)["runs"][0]
    if run.get("error") or run.get("decode_bytes_read_per_token") is None:
        raise SystemExit(f"{case['model']} {case['limit']}: the page-cache run gave no read count: {run.get('error')}")
    return run["decode_tokens_per_s"], run["decode_bytes_read_per_token"] / MIB


if __name__ == "__main__":
    main()
