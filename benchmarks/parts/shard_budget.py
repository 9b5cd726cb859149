"""Experts on shards against one process streaming, every process under the same memory budget (issue 51's target).

One machine as a local Ray cluster (started here, outside every cgroup). Each run is a `weightstream generate MODEL
--memory BUDGET --routing-trace TRACE --json` process inside a memory cgroup of BUDGET (root), rounds alternated:

- one process: it streams from disk what its cache of BUDGET cannot hold;
- N shards: the same command with `--expert-shards N --shard-memory BUDGET --shard-heat HEAT --ray-address` this
  cluster: each shard moves itself into a cgroup of BUDGET of its own and keeps the hottest experts that fit; the
  head (in its cgroup of BUDGET) reads from disk only what no shard holds.

The routing is a real trace replayed (TRACE, e.g. DeepSeek-V2-Lite's first 40 prompts), the placement's heat from
another part of it (HEAT, the other prompts), so the plan is not fitted to what is replayed. Reported per run: decode
tok/s, MiB read from disk a decode token, the tokens (equal in every run, or the benchmark fails), the cgroup's peak
and OOM kills; for shards, per shard: round trips, their mean, the shard's own compute a trip, bytes each way a
token. Then:

- `--delay-us US`: one more sharded run a round with US microseconds added to each layer's round trip (a LAN's
  latency), against what the local run's figures project for it;
- a projection for `--machines` machines on a `--gbps` network: the head's time a token as measured, plus each
  trip's shard compute as measured, the network's latency (`--lan-rtt-us`) and the bytes at its bandwidth;
- `--kill`: one more sharded run a round in which shard 0's process is SIGKILLed `--kill-after` seconds into
  decode: its tokens (equal), the head's fallbacks, whether the shard was taken back, its tok/s against the
  undisturbed run's; with `--replicas N`, one more such run with `--shard-replicas N` (the N hottest experts held
  twice, in the room the budget leaves): what the copies save while the shard restarts.

    sudo .venv/bin/python benchmarks/serve_bench.py shard-budget .work/olmoe16/q4 --budget 1.75GiB \\
        --trace .work/ds.npz --heat .work/ds-heat.npz --shards 3 --rounds 3 --delay-us 200 --kill \\
        --out benchmarks/results/shard-budget-olmoe16.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common.results import default, emit

from weightstream.bench.calibration_store import cpu_model
from weightstream.cgroup import MemoryCgroup
from weightstream.units import parse_size

MIB = 2**20


def _command(args, shards: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "weightstream.cli", "generate", args.model, "--prompt-ids", args.prompt_ids]
    cmd += ["--max-new-tokens", str(args.tokens), "--memory", args.budget, "--routing-trace", args.trace, "--json"]
    if shards:
        cmd += ["--expert-shards", str(shards), "--shard-memory", args.budget, "--ray-address", args.address]
        cmd += ["--shard-placement", args.placement, "--shard-transport", args.transport]
        cmd += ["--shard-heat", args.heat] if args.heat else []
    return cmd + extra


def _kill_when_decoding(plan_path: str, after_s: float, killed: dict) -> None:
    """SIGKILL shard 0 `after_s` seconds after the plan is written (the shards built, prefill about to start)."""
    deadline = time.monotonic() + 900
    while not os.path.exists(plan_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(after_s)
    pid = json.load(open(plan_path))["shards"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed.update(pid=pid, at=time.time())


def _run(args, shards: int, delay_us: float = 0.0, kill: bool = False, replicas: int = 0) -> dict:
    budget = parse_size(args.budget, "--budget")
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "plan.json")
        extra = ["--shard-plan", plan] if shards else []
        extra += ["--shard-delay-us", str(delay_us)] if delay_us else []
        extra += ["--shard-replicas", str(replicas)] if replicas else []
        killed: dict = {}
        if kill:
            threading.Thread(target=_kill_when_decoding, args=(plan, args.kill_after, killed), daemon=True).start()
        with MemoryCgroup.create(budget, name="ws-shard-bench") as group:
            start = time.monotonic()
            proc = group.popen(_command(args, shards, extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = proc.communicate(timeout=1800)
            figures = {"peak_mib": round((group.peak_bytes or 0) / MIB, 1), "oom_kills": group.oom_kills}
    if proc.returncode != 0:
        raise SystemExit(f"{'sharded' if shards else 'one process'} run failed ({proc.returncode}):\n{err[-3000:]}")
    report = json.loads(out)
    stats = report["stats"]
    decode_tokens = max(1, args.tokens - 1)
    run = {
        "decode_tok_s": round(stats["decode_tokens_per_s"], 3),
        "mib_read_per_decode_token": round(stats["bytes_read_per_token"] / MIB, 2),
        "wall_s": round(time.monotonic() - start, 1),
        **figures,
        "token_ids": report["token_ids"],
    }
    if shards:
        sharded = stats["expert_shards"]
        traffic = sharded["traffic"]
        trips = sum(t["round_trips"] for t in traffic)
        run["head_reads_experts"] = len(sharded["head_reads"])
        run["replicated"] = sharded.get("replicated", 0)
        run["shards"] = [
            {
                "experts": len(s["held"]),
                # the shard's own memory cgroup by name (its path names this machine), or why it had none
                "up": s["up"],
                "cgroup": os.path.basename(s.get("cgroup") or "")
                if (s.get("cgroup") or "").startswith("/")
                else s.get("cgroup"),
                "rss_mib": round(s["rss_bytes"] / MIB, 1) if "rss_bytes" in s else None,
                "round_trips": t["round_trips"],
                "round_trip_mean_us": t["round_trip_mean_us"],
                "shard_compute_mean_us": t.get("shard_compute_mean_us"),
                "failures": t["failures"],
                "fallback_rows": t["fallback_rows"],
                "readmitted": t["readmitted"],
            }
            for s, t in zip(sharded["shards"], traffic)
        ]
        tokens = args.tokens + len(args.prompt_ids.split(","))  # positions through the model
        run["round_trips_per_token"] = round(trips / args.tokens, 2)
        run["bytes_out_per_position"] = round(sum(t["bytes_out"] for t in traffic) / tokens)
        run["bytes_in_per_position"] = round(sum(t["bytes_in"] for t in traffic) / tokens)
        run["round_trip_mean_us"] = round(sum(t["round_trip_s"] for t in traffic) / max(1, trips) * 1e6, 1)
        up = [t for t in traffic if t.get("shard_compute_mean_us") is not None and t["round_trips"]]
        run["shard_compute_mean_us"] = (
            round(sum(t["shard_compute_s"] for t in up) / max(1, sum(t["round_trips"] for t in up)) * 1e6, 1)
            if up
            else None
        )
        run["decode_tokens"] = decode_tokens
    if kill:
        run["killed_pid"] = killed.get("pid")
    return run


def _projection(run: dict, args) -> dict:
    """The local sharded run's figures with the trips over a network of `args.machines` machines: what a token costs
    the head (measured: its time less the trips), plus each trip's shard compute (measured), the LAN's latency, and
    the bytes of a trip at the network's bandwidth. Shards sharing 2 vCPUs with the head compute slower than they
    would on machines of their own: the projection keeps the measured (slower) compute."""
    token_s = 1 / run["decode_tok_s"]
    trips = run["round_trips_per_token"]
    head_s = token_s - trips * run["round_trip_mean_us"] / 1e6
    trip_bytes = (run["bytes_out_per_position"] + run["bytes_in_per_position"]) / max(trips, 1e-9)
    wire_s = trip_bytes * 8 / (args.gbps * 1e9)
    trip_s = run["shard_compute_mean_us"] / 1e6 + args.lan_rtt_us / 1e6 + wire_s
    return {
        "machines": args.machines,
        "gbps": args.gbps,
        "lan_rtt_us": args.lan_rtt_us,
        "head_ms_per_token": round(head_s * 1e3, 2),
        "trips_per_token": trips,
        "bytes_per_trip": round(trip_bytes),
        "wire_us_per_trip": round(wire_s * 1e6, 2),
        "trip_us": round(trip_s * 1e6, 1),
        "decode_tok_s": round(1 / (head_s + trips * trip_s), 2),
    }


def main(argv=None, prog: str = "serve_bench.py shard-budget") -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model directory with native GGML-block experts (quantize or import)")
    ap.add_argument("--budget", default="1.75GiB", help="each process's memory, and its cgroup (default 1.75GiB)")
    ap.add_argument("--trace", required=True, help="the routing trace replayed (.npz)")
    ap.add_argument("--heat", help="the routing trace the placement's heat comes from (.npz; default: none)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--placement", default="layers", choices=("layers", "spread"))
    ap.add_argument("--transport", default="graph", choices=("graph", "calls"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a run (default 64)")
    ap.add_argument("--prompt-ids", default="3,17,101,250,7,42,311,5")
    ap.add_argument("--delay-us", type=float, default=0.0, help="also a run with this delay a round trip")
    ap.add_argument("--kill", action="store_true", help="also a run in which shard 0 is killed mid-decode")
    ap.add_argument("--kill-after", type=float, default=4.0, help="seconds after the plan is written (default 4)")
    ap.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="with --kill: also a killed run with --shard-replicas N (copies of the N hottest experts)",
    )
    ap.add_argument("--machines", type=int, default=4, help="the projection's machines: a head and N-1 shards")
    ap.add_argument("--gbps", type=float, default=25.0, help="the projection's network (default 25 Gb/s)")
    ap.add_argument("--lan-rtt-us", type=float, default=50.0, help="the projection's round trip latency (default 50)")
    ap.add_argument("--out", default=default("shard-budget.json"))
    args = ap.parse_args(argv)
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    args.address = ray.get_runtime_context().gcs_address
    rounds = []
    try:
        for r in range(args.rounds):
            order = (0, args.shards) if r % 2 == 0 else (args.shards, 0)
            runs = {("sharded" if s else "one process"): _run(args, s) for s in order}
            if args.delay_us:
                runs["sharded, delayed"] = _run(args, args.shards, delay_us=args.delay_us)
            if args.kill:
                runs["sharded, shard 0 killed"] = _run(args, args.shards, kill=True)
            if args.kill and args.replicas:
                runs["sharded with copies, shard 0 killed"] = _run(args, args.shards, kill=True, replicas=args.replicas)
            want = runs["one process"]["token_ids"]
            differ = [name for name, run in runs.items() if run["token_ids"] != want]
            if differ:
                raise SystemExit(f"round {r}: the tokens of {differ} differ from one process's")
            one, sharded = runs["one process"], runs["sharded"]
            entry = {"runs": runs, "ratio": round(sharded["decode_tok_s"] / one["decode_tok_s"], 3)}
            entry["projection"] = _projection(sharded, args)
            if args.delay_us:
                token_s = 1 / sharded["decode_tok_s"] + sharded["round_trips_per_token"] * args.delay_us / 1e6
                entry["delayed_projected_tok_s"] = round(1 / token_s, 3)
                entry["delayed_measured_tok_s"] = runs["sharded, delayed"]["decode_tok_s"]
            if args.kill:
                entry["killed_over_sharded"] = round(
                    runs["sharded, shard 0 killed"]["decode_tok_s"] / sharded["decode_tok_s"], 3
                )
            if args.kill and args.replicas:
                entry["killed_with_copies_over_sharded"] = round(
                    runs["sharded with copies, shard 0 killed"]["decode_tok_s"] / sharded["decode_tok_s"], 3
                )
            for run in runs.values():
                run.pop("token_ids")
            rounds.append(entry)
            print(f"[shard-budget] round {r + 1}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    ratios = [e["ratio"] for e in rounds]
    emit(
        {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "model": args.model,
            "budget": args.budget,
            "trace": args.trace,
            "heat": args.heat,
            "shards": args.shards,
            "placement": args.placement,
            "transport": args.transport,
            "tokens": args.tokens,
            "tokens_equal": True,
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
            "replicas": args.replicas,
            "rounds": rounds,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
