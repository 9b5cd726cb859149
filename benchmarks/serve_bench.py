"""`weightstream serve` with concurrent clients, each against its baseline in the same run; `serve` against
llama-server is `llamacpp.py serve`.

    concurrency   concurrent clients under a memory limit (root): aggregate tok/s, time per output token, device
                  bytes a token, the expert union of batched steps; against the same requests one at a time
    ray           `serve --ray`: Ray Serve replicas routed by expert affinity, against Ray Serve's default router
                  on the same replicas, prompts and routing, rounds alternated; `ray simulate`: the same requests
                  through one LRU cache per replica (seconds, no Ray)
    load          minutes of concurrent clients, streamed and not, cancelled mid-answer and bad requests among
                  them: errors for good requests, 4xx for bad ones, the server's RSS after warm-up against the end,
                  and its idle metrics (every cancelled sequence freed)
    shard-trip    one MoE layer's round trip to Ray actors holding experts (issue 51): actor calls and a compiled
                  graph, against a call in this process
    shard-decode  `generate --expert-shards N` against one process holding every expert, rounds alternated
    shard-budget  N shards against one process streaming, each process in a memory cgroup of the same budget
                  (root), a real trace replayed; a run with a LAN's delay injected, a run with a shard killed, and
                  a projection for machines on a network

    sudo .venv/bin/python benchmarks/serve_bench.py concurrency MODEL --routing-trace ds.npz --memory-limit 5GiB
    .venv/bin/python benchmarks/serve_bench.py ray MODEL --trace .work/ds.npz --expert-cache 2x --rounds 3
    .venv/bin/python benchmarks/serve_bench.py ray simulate MODEL --trace .work/ds.npz --caches 1x,2x,4x
    .venv/bin/python benchmarks/serve_bench.py load --duration 300 --clients 32 -o benchmarks/results/serve-load.json
    .venv/bin/python benchmarks/serve_bench.py shard-trip --shards 1,3 --rows 8,64 --hidden 7168 --rounds 3
    .venv/bin/python benchmarks/serve_bench.py shard-decode .work/olmoe4/q4 --shards 2 --rounds 3
    sudo .venv/bin/python benchmarks/serve_bench.py shard-budget .work/olmoe16/q4 --budget 1.75GiB \
        --trace .work/ds.npz --heat .work/ds-heat.npz --shards 3 --rounds 3 --delay-us 200 --kill

Each prints one JSON object and writes it to --out. The subcommands run parts/serve_concurrency.py,
parts/serve_ray.py, parts/serve_load.py, parts/shard_trip.py, parts/shard_decode.py and parts/shard_budget.py;
`serve_bench.py PART
--help`.
"""

from __future__ import annotations

from common import Part, entry

PARTS = {
    "concurrency": Part("serve_concurrency", "concurrent clients under a memory limit, against one at a time"),
    "ray": Part("serve_ray", "Ray Serve replicas by expert affinity against the default router; `ray simulate`"),
    "load": Part("serve_load", "minutes of clients with cancellations and bad requests: errors, RSS, idle metrics"),
    "shard-trip": Part("shard_trip", "a MoE layer's round trip to Ray actors holding experts, against a local call"),
    "shard-decode": Part("shard_decode", "generate --expert-shards N against one process holding every expert"),
    "shard-budget": Part("shard_budget", "N shards against one process streaming, each in a cgroup of one budget"),
}

if __name__ == "__main__":
    entry("serve_bench.py", __doc__, PARTS)
