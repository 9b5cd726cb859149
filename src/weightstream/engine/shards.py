"""Experts computed in other processes, each set by a shard that holds it in its own memory (issue 51, a first step).

A shard loads the model from the files it can reach with an expert cache of exactly its experts, reads them once, and
computes their contributions to a layer for the rows a head sends it. The head (`ShardedExperts`) computes its own
experts as the engine always does and writes each shard's rows into the layer's contributions, which the native
layer sums in ascending expert order: the tokens are bitwise those of one process holding every expert. Only for
kernels that run a layer natively (the GGML-block kernels, `fused`); the head's cache is never asked for a shard's
expert.

`ExpertShard` is a plain class: `ray.remote(ExpertShard)` makes it an actor (`shard_actors`), and in one process
it is its own reference; `generate --expert-shards N` runs them on a local Ray cluster (`sharded`). Not yet here
(issue 51): heat measured from a trace or the run for `place`, a shard's death, `serve`, per-shard metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from weightstream import native
from weightstream.cache.policy import split_waves
from weightstream.engine.experts import arrivals, contribute_groups, empty_contributions
from weightstream.errors import WeightstreamError

Key = tuple[int, int]  # (layer, expert)


class ExpertShard:
    """Holds `keys` of the model at `model_dir` in memory and computes their contributions to a layer."""

    def __init__(self, model_dir: str, keys: list[Key], io_threads: int = 2):
        from weightstream.engine.config import EngineConfig
        from weightstream.engine.loader import load_streaming_model
        from weightstream.store.model import map_model

        self.keys = sorted(set(map(tuple, keys)))
        layout = map_model(model_dir).layout
        unknown = [k for k in self.keys if k not in layout.experts]
        if unknown:
            raise WeightstreamError(f"expert shard: {model_dir} has no expert {unknown[0]} (layer, expert)")
        slots = max(len(self.keys), len(layout.num_experts) * layout.top_k)  # a cache holds one token's at least
        config = EngineConfig(expert_cache=slots * layout.slot_bytes, io_threads=io_threads)
        self.model = load_streaming_model(model_dir, config)
        self.runtime = self.model.weightstream
        try:
            self.kernels = {part.layer: part.kernel for part in self.runtime._parts.values()}
            for layer in sorted({layer for layer, _ in self.keys}):
                if not getattr(self.kernels[layer], "fused", False):
                    raise WeightstreamError(
                        f"expert shard: layer {layer}'s experts run the {self.kernels[layer].name} kernel; shards "
                        "compute the native GGML-block kernels only: `weightstream quantize` the model first"
                    )
                self._load(layer, [e for at, e in self.keys if at == layer])
        except BaseException:
            self.runtime.close()  # its I/O threads and leases
            raise

    def _load(self, layer: int, experts: list[int]) -> None:
        cache = self.runtime.cache
        fetch = cache.fetch_layer(layer, experts)
        for _ in fetch.missing:
            cache.wait(fetch)

    def contribute(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: list[int],
    ) -> torch.Tensor:
        """The contributions (tokens, top-k, hidden; float32) of `experts` of `layer`: their (token, k) rows filled,
        the others 0."""
        cache = self.runtime.cache
        contrib = empty_contributions(hidden_states, top_k_index)
        groups = (group for group, _ in arrivals(cache, layer, [sorted(experts)], lambda s: None))
        contribute_groups(contrib, self.kernels[layer], cache, layer, hidden_states, top_k_index, top_k_weights, groups)
        return contrib

    def resident(self) -> list[Key]:
        """The keys this shard holds (all of them, once built)."""
        return self.keys

    def close(self) -> None:
        self.runtime.close()


class ShardedExperts:
    """The head's side: which shard computes which (layer, expert), and a layer computed with their rows."""

    def __init__(self, owners: Mapping[Key, object], submit, result):
        """`owners`: (layer, expert) -> its shard; `submit(shard, *args)` starts `shard.contribute(*args)` and
        returns a handle, `result(handle)` its contributions (for Ray: `.remote` and `ray.get`)."""
        self.owners, self.submit, self.result = dict(owners), submit, result

    def compute_layer(self, kernel, source, layer, hidden_states, top_k_index, top_k_weights, io_wait):
        """The layer's combined expert output: the shards' experts sent first, the head's own computed meanwhile."""
        chosen = sorted(set(top_k_index.reshape(-1).tolist()))
        remote: dict[int, tuple[object, list[int]]] = {}
        for e in chosen:
            shard = self.owners.get((layer, e))
            if shard is not None:
                remote.setdefault(id(shard), (shard, []))[1].append(e)
        handles = [
            (self.submit(shard, layer, hidden_states, top_k_index, top_k_weights, members), members)
            for shard, members in remote.values()
        ]
        far = {e for _, members in remote.values() for e in members}
        local = [e for e in top_k_index.reshape(-1).tolist() if e not in far]  # token by token, as the engine looks up
        contrib = empty_contributions(hidden_states, top_k_index)
        if local:
            groups = (group for group, _ in arrivals(source, layer, split_waves(local, source.n_slots), io_wait))
            contribute_groups(contrib, kernel, source, layer, hidden_states, top_k_index, top_k_weights, groups)
        for handle, members in handles:
            rows = torch.isin(top_k_index, torch.tensor(members))
            contrib[rows] = self.result(handle)[rows]
        return native.moe_sum(contrib, top_k_index, hidden_states)


def shard_actors(model_dir: str, placement: list[list[Key]], io_threads: int = 2) -> ShardedExperts:
    """One Ray actor a set of keys in `placement` (Ray must be initialised), each built and holding its experts
    before this returns; the head's ShardedExperts over them."""
    import ray

    actor = ray.remote(num_cpus=0)(ExpertShard)
    shards = [actor.remote(model_dir, keys, io_threads) for keys in placement]
    held = ray.get([s.resident.remote() for s in shards])
    owners = {tuple(k): s for s, keys in zip(shards, held) for k in keys}
    return ShardedExperts(owners, lambda s, *args: s.contribute.remote(*args), ray.get)


def place(keys: list[Key], shards: int, heat: Mapping[Key, float] | None = None) -> list[list[Key]]:
    """`keys` over `shards` sets, each layer's experts balanced by `heat` (its expected lookups; none: all alike):
    hottest first, each to the shard with the least heat of that layer so far (ties: the fewest experts, then the
    first shard)."""
    if shards < 1:
        raise WeightstreamError(f"--expert-shards {shards}: give 1 or more shards")
    heat_of = lambda key: (heat or {}).get(key, 1.0)
    placement: list[list[Key]] = [[] for _ in range(shards)]
    for layer in sorted({layer for layer, _ in keys}):
        load = [(0.0, 0, i) for i in range(shards)]
        for key in sorted((k for k in keys if k[0] == layer), key=lambda k: (-heat_of(k), k)):
            weight, count, i = min(load)
            placement[i].append(key)
            load[i] = (weight + heat_of(key), count + 1, i)
    return placement


@contextlib.contextmanager
def sharded(model, model_dir: str, shards: int, address: str | None = None, io_threads: int = 2) -> Iterator[dict]:
    """`model`'s experts computed by `shards` Ray actors, every expert on one of them, for the block: Ray started
    here (a local cluster, or `address`'s) and shut down after. Yields the placement: {shard: [[layer, expert]]}."""
    try:
        import ray
    except ImportError:
        raise WeightstreamError(
            "--expert-shards runs the shards as Ray actors: install Ray with pip install 'weightstream[ray]'"
        ) from None
    placement = place(sorted(model.weightstream.layout.experts), shards)
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    try:
        model.weightstream.shards = shard_actors(model_dir, placement, io_threads)
        yield {i: [list(k) for k in keys] for i, keys in enumerate(placement)}
    finally:
        model.weightstream.shards = None
        ray.shutdown()
