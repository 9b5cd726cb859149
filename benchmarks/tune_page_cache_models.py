"""Both page-cache models of `tune` on each case of `tune_proof.py` reports, against the measured page-cache rows.

Each case's stored calibration and routing go through `Search.page_cache` twice: with the checkpoint's byte ranges
(the kernel's two lists, `sim.page_cache_model`) and without them (LRU over whole experts, room / readahead).
Run from the repository root after the proof, which leaves its replay traces in .work/tune-proof:

    PYTHONPATH=src .venv/bin/python benchmarks/tune_page_cache_models.py docs/tune-proof-olmoe-evening.json ...

Prints one Markdown row per case: measured tok/s, then each model's prediction (error; fault-free share, MiB read
per token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from weightstream.commands.tune_steps import TuneSession
from weightstream.sim.overlap_model import CostParams
from weightstream.sim.tune import Search
from weightstream.units import parse_size


def routing_file(case: dict) -> str:
    model = Path(case["model"])
    if case["routing"] == "own":
        return str(model / ".weightstream" / "routing-recorded.npz")
    return f".work/tune-proof/{model.name}-{case['routing']}-16.npz"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+")
    for path in p.parse_args().reports:
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
            print(
                f"| {Path(c['model']).name} {c['limit']} {c['routing']} | {measured:.2f} | " + " | ".join(cells) + " |"
            )


if __name__ == "__main__":
    main()
