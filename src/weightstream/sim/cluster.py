"""A cluster of expert shards priced from a routing trace before it is run (`simulate --shards`; issue 51).

The plan is the one `generate --expert-shards` would build (engine/shards.py's `place`, heat from the trace's first
`train_share` of requests): each shard keeps the hottest of its share that fit in its memory beside its process
(`shard_base`, measured: docs/serving.md); the head keeps the rest in an LRU cache of `head_cache` bytes and reads
its misses from disk. The judged requests are replayed token by token: a layer whose chosen experts are on shards
costs one network round trip (the shards of a layer answer in parallel), the bytes of the rows that travel (hidden
rows out in bf16, each shard-computed (token, k) row back in float32) at the network's bandwidth, and the head reads
its misses. What the shards' compute costs is not priced here: it is the same compute one process does.

With `replicas`, the hottest experts get a second copy after each shard's own share (sim/placement.py's `copies`, as
`--shard-replicas`), dropped first where a shard's memory runs short; with `down`, those shards are priced dead: an
expert goes to its home shard while that is up and holds it, else to a live copy, else to the head (as the runtime's
`ShardedExperts.assign`), so the degraded cluster's reads are priced before a shard is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from weightstream.cgroup import margin_for
from weightstream.errors import WeightstreamError
from weightstream.sim.placement import check_replicas, copies, heat_counts, place
from weightstream.trace import Trace
from weightstream.trace.remap import token_rows

MIB = 2**20


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    shards: int
    shard_memory: int  # bytes each shard may hold, its process included
    shard_base: int  # what a shard's process holds before any expert (interpreter, torch, the model's skeleton)
    head_cache: int  # the head's expert cache, bytes
    hidden: int  # the model's hidden size
    gbps: float = 25.0  # the network's bandwidth, gigabits a second
    rtt_us: float = 50.0  # a round trip's latency on it
    placement: str = "layers"
    replicas: int = 0  # the hottest experts given a second copy (`--shard-replicas`)
    down: tuple[int, ...] = ()  # shards priced as dead


def _token_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """[tokens, layers, k] choices and each token's request id."""
    choices = token_rows(trace)
    request = np.repeat(trace.step_request, trace.step_tokens)
    return choices, request


def price_cluster(trace: Trace, spec: ClusterSpec, train_share: float = 0.5) -> dict:
    """What `spec`'s cluster holds and what a judged token costs it: round trips, network bytes and time, head reads."""
    if spec.shards < 1:
        raise WeightstreamError(f"--shards {spec.shards}: give 1 or more")
    check_replicas(spec.replicas, spec.shards)
    bad = [i for i in spec.down if not 0 <= i < spec.shards]
    if bad or len(set(spec.down)) != len(spec.down):
        raise WeightstreamError(
            f"--shard-down {','.join(map(str, spec.down))}: give distinct shard numbers from 0 to {spec.shards - 1}"
        )
    if not 0 <= train_share < 1:
        raise WeightstreamError(f"--train-share {train_share}: must be in [0, 1)")
    shape = trace.shape
    choices, request = _token_rows(trace)
    first_judged = int(np.ceil(train_share * len(trace.requests)))
    train, judged = choices[request < first_judged], choices[request >= first_judged]
    if not len(judged):
        raise WeightstreamError(f"--train-share {train_share}: leaves no request of the trace to judge")
    layers = range(choices.shape[1])
    heat = heat_counts(train, list(layers), shape.n_experts)
    expert_bytes = max(shape.expert_bytes)
    room = max(0, (spec.shard_memory - margin_for(spec.shard_memory) - spec.shard_base) // expert_bytes)
    own = place(sorted(heat), spec.shards, heat if train_share else None, spec.placement)
    extra = copies(own, spec.replicas, heat if train_share else None)
    held = [set((a + b)[:room]) for a, b in zip(own, extra)]
    home = {key: s for s, keys in enumerate(own) for key in keys}
    live = [s for s in range(spec.shards) if s not in spec.down]
    owner = {}  # the shard that computes each expert: its home while up and holding it, else a live copy
    for key in heat:
        serving = [s for s in [home[key], *live] if s in live and key in held[s]]
        if serving:
            owner[key] = serving[0]
    head_slots = max(0, spec.head_cache // expert_bytes)
    cache: OrderedDict = OrderedDict()
    trips = layer_trips = misses = shard_rows = head_rows = 0
    bytes_out = bytes_in = 0
    for token in judged:
        for i in layers:
            involved: set[int] = set()
            for e in token[i]:
                if e < 0:
                    continue
                key = (i, int(e))
                shard = owner.get(key)
                if shard is not None:
                    involved.add(shard)
                    shard_rows += 1
                    bytes_in += 4 * spec.hidden
                    continue
                head_rows += 1
                if key in cache:
                    cache.move_to_end(key)
                    continue
                misses += 1
                if head_slots:
                    cache[key] = True
                    if len(cache) > head_slots:
                        cache.popitem(last=False)
            trips += len(involved)
            layer_trips += bool(involved)
            bytes_out += len(involved) * (2 * spec.hidden + 12 * shape.top_k)  # a bf16 row, its int64 index, weights
    n = len(judged)
    wire_s = (bytes_out + bytes_in) * 8 / (spec.gbps * 1e9)
    network_s = layer_trips * spec.rtt_us / 1e6 + wire_s
    return {
        "shards": spec.shards,
        "placement": spec.placement,
        "shard_memory_mib": round(spec.shard_memory / MIB, 1),
        "shard_base_mib": round(spec.shard_base / MIB, 1),
        "experts_per_shard": room,
        "experts_on_shards": len(owner),
        "replicas": spec.replicas,
        "experts_held_twice": sum(sum(key in h for h in held) > 1 for key in heat),
        "down": list(spec.down),
        "experts": len(heat),
        "head_cache_experts": head_slots,
        "judged_tokens": n,
        "share_of_lookups_on_shards": round(shard_rows / max(1, shard_rows + head_rows), 4),
        "round_trips_per_token": round(trips / n, 2),
        "layers_with_a_trip_per_token": round(layer_trips / n, 2),
        "network_bytes_per_token": round((bytes_out + bytes_in) / n),
        "network_ms_per_token": round(1e3 * network_s / n, 3),
        "head_misses_per_token": round(misses / n, 2),
        "head_mib_read_per_token": round(misses * expert_bytes / n / MIB, 2),
        "gbps": spec.gbps,
        "rtt_us": spec.rtt_us,
    }
