"""What one MoE layer's round trip to Ray actors costs (issue 51, item 1: experts sharded over Ray actors).

With experts held by shard actors, each MoE layer of each step sends every shard the hidden-state rows routed to
its experts and gets as many rows back; the head waits for all of them before the next layer. This part measures
that round trip with shards that do no work (each returns its rows: the transport alone), on one machine as a local
Ray cluster, three ways, alternated per round:

- local: the rows through a function call in this process: what one process pays (the baseline);
- actor calls: `shard.rows.remote(part)` to every shard, then one `ray.get` (the object store);
- compiled graph: the same calls compiled once (`experimental_compile`: shared-memory channels set up at compile
  time, no scheduler on the path), executed once a layer.

Payloads: --rows rows of --hidden bfloat16 values a layer (DeepSeek-V3/Kimi-K2: 7168; 8 rows is one token's top-8,
64 a batch of 8 tokens), split evenly over --shards actors, as torch tensors (what the engine holds). Reported per
way and payload: the median and 90th percentile of a layer's round trip in microseconds over --calls calls a round,
the bytes each way, and the ratio to the local call's median. A step of a 58-layer model pays 58 of them.

    .venv/bin/python benchmarks/serve_bench.py shard-trip --shards 1,3 --rows 8,64 --hidden 7168 --rounds 3 \\
        --out benchmarks/results/shard-trip.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common.results import default, emit

from weightstream.bench.calibration_store import cpu_model


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(call, calls: int) -> list[float]:
    """Microseconds of each of `calls` calls of `call()`, after 10 not timed."""
    for _ in range(10):
        call()
    out = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def _ways(ray, shards: int, parts: list[torch.Tensor]) -> tuple[dict, object]:
    """name -> a function running one layer's round trip; and the compiled graph (to tear down)."""
    from ray.dag import InputNode, MultiOutputNode

    @ray.remote(num_cpus=0)
    class Shard:
        def rows(self, x: torch.Tensor) -> torch.Tensor:
            return x

    actors = [Shard.remote() for _ in range(shards)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    with InputNode() as inp:
        dag = MultiOutputNode([a.rows.bind(inp[i]) for i, a in enumerate(actors)])
    compiled = dag.experimental_compile()

    def local() -> list[torch.Tensor]:
        return [p.clone() for p in parts]  # a shard in this process would hand back rows of its own

    def actor_calls() -> list[torch.Tensor]:
        return ray.get([a.rows.remote(p) for a, p in zip(actors, parts)])

    def compiled_graph() -> list[torch.Tensor]:
        return ray.get(compiled.execute(*parts))

    return {"local": local, "actor calls": actor_calls, "compiled graph": compiled_graph}, compiled


def _case(ray, shards: int, rows: int, args) -> dict:
    per = -(-rows // shards)
    parts = [torch.randn(per, args.hidden).bfloat16() for _ in range(shards)]
    ways, compiled = _ways(ray, shards, parts)
    back = ways["compiled graph"]()
    assert all(torch.equal(a, b) for a, b in zip(back, parts)), "the compiled graph returned other rows"
    rounds = []
    try:
        for r in range(args.rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            rounds.append({name: _timed(ways[name], args.calls) for name in order})
    finally:
        compiled.teardown()
    result = {"shards": shards, "rows": rows, "bytes_each_way": per * shards * args.hidden * 2, "ways": {}}
    for name in ways:
        medians = [statistics.median(r[name]) for r in rounds]
        result["ways"][name] = {
            "median_us": round(statistics.median(medians), 1),
            "p90_us": round(statistics.median(_percentile(r[name], 0.9) for r in rounds), 1),
            "median_us_by_round": [round(m, 1) for m in medians],
        }
    local = result["ways"]["local"]["median_us"]
    for name in ways:
        result["ways"][name]["over_local"] = round(result["ways"][name]["median_us"] / local, 1)
    return result


def main(argv=None, prog: str = "serve_bench.py shard-trip") -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1,3", help="shard actors, comma-separated (default 1,3)")
    ap.add_argument("--rows", default="8,64", help="rows a layer, comma-separated (default 8,64)")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168: DeepSeek-V3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300, help="timed round trips a way and round (default 300)")
    ap.add_argument("--out", default=default("shard-trip.json"))
    args = ap.parse_args(argv)
    import ray

    shard_counts = [int(s) for s in args.shards.split(",")]
    ray.init(num_cpus=max(shard_counts) + 1, include_dashboard=False, log_to_driver=False)
    try:
        cases = [_case(ray, s, int(rows), args) for s in shard_counts for rows in args.rows.split(",")]
    finally:
        ray.shutdown()
    emit(
        {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "ray": ray.__version__,
            "hidden": args.hidden,
            "rounds": args.rounds,
            "calls": args.calls,
            "cases": cases,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
