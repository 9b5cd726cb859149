"""Warm restart: the first tokens after a restart with `--warm-restart`, against the previous run's steady state and
against a cold restart, each run a fresh process with the model's files dropped from the page cache.

A round: (1) a run with --warm-restart decodes `--warmup` tokens, then `--tokens` more, timed: its steady state;
it saves the cache's contents at exit. (2) a restart with --warm-restart decodes `--tokens` tokens, timed from the
first (the cache refills in the background while it runs). (3) a cold restart (no saved state) decodes the same.
Routing is a trace replayed (the shared DeepSeek-V2-Lite one), the restarts continuing the workload where the
first run stopped, so what was hot stays hot as it does for a server. Reports tok/s of each and the ratios.

    .venv/bin/python benchmarks/memory_bench.py warm-restart .work/olmoe4/q4 --trace .work/ds.npz --rounds 3 \\
        [--expert-cache 3x] [--tokens 32] [--warmup 96] [--out benchmarks/results/warm-restart-olmoe4.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from common.child import json_child
from common.results import default, emit

_RUN = """
import json, sys, torch
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.engine.routing import RoutingReplay
from weightstream.trace import load
trace = load({trace!r})
model = load_streaming_model({model!r}, expert_cache={cache!r}, warm_restart={warm}, io_threads=4)
runtime = model.weightstream
replay = RoutingReplay(trace, runtime.layout)
replay.cursor = {cursor}
runtime.routing_override = replay
prompt = torch.tensor([[5, 17, 101, 250, 7, 42, 311, 9]])
if {warmup}:
    generate(model, prompt, max_new_tokens={warmup})
_, stats = generate(model, prompt, max_new_tokens={tokens})
out = {{"tokens_per_s": {tokens} / (stats.prefill_s + stats.decode_s), "decode_tokens_per_s": stats.decode_tokens_per_s,
       "hit_rate": stats.expert_hit_rate, "warm_issued": runtime.cache.stats.warm_issued,
       "cursor": replay.cursor + replay._last_tokens}}
runtime.close()
print(json.dumps(out))
"""


def run(args, warm: bool, cursor: int, warmup: int) -> dict:
    from weightstream.bench.coldstart import drop_page_cache
    from weightstream.store.checkpoint import open_checkpoint

    drop_page_cache(open_checkpoint(args.model).files)
    code = _RUN.format(
        trace=args.trace,
        model=args.model,
        cache=args.expert_cache,
        warm=warm,
        cursor=cursor,
        warmup=warmup,
        tokens=args.tokens,
    )
    return json_child(code, "the timed run failed", timeout=1800)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--expert-cache", default="3x")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=default("warm-restart.json"))
    args = ap.parse_args(argv)
    from weightstream.cache.warm import state_path

    rounds = []
    for r in range(args.rounds):
        state = state_path(args.model)
        if os.path.exists(state):
            os.unlink(state)
        first = run(args, True, 0, args.warmup)
        cursor = first["cursor"]
        # the two restarts in alternating order (the cold one neither reads nor writes the saved state)
        order = ["warm", "cold"] if r % 2 == 0 else ["cold", "warm"]
        got = {kind: run(args, kind == "warm", cursor, 0) for kind in order}
        rounds.append({"steady": first, **got})
        print(f"[warm-restart] round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    ratio = lambda kind: [x[kind]["tokens_per_s"] / x["steady"]["tokens_per_s"] for x in rounds]  # noqa: E731
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "trace": args.trace,
        "expert_cache": args.expert_cache,
        "tokens": args.tokens,
        "rounds": rounds,
        "warm_over_steady": {"per_round": ratio("warm"), "median": statistics.median(ratio("warm"))},
        "cold_over_steady": {"per_round": ratio("cold"), "median": statistics.median(ratio("cold"))},
    }
    emit(report, args.out)
