"""Which expert shard holds which (layer, expert): the plan `generate --expert-shards` builds (engine/shards.py)
and `simulate --shards` prices (sim/cluster.py)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from weightstream.errors import WeightstreamError

PLACEMENTS = ("layers", "spread")

Key = tuple[int, Hashable]  # (layer, expert)


def place(
    keys: Sequence[Key], shards: int, heat: Mapping[Key, float] | None = None, how: str = "layers"
) -> list[list[Key]]:
    """`keys` over `shards` lists, each in the order a shard keeps them: hottest by `heat` first (expected lookups;
    none: all alike), so that one short of memory drops the coldest.

    - layers: consecutive layers to each shard, as many experts each (a layer split at most between two): one round
      trip a layer, to one shard, mostly; for shards that share a machine's cores, or when the trip costs more than
      the compute it moves;
    - spread: each layer's experts over every shard, hottest first, each to the shard with the least heat of that
      layer so far (ties: the fewest experts, then the first shard): a layer's compute in parallel on every shard,
      for shards on machines of their own.
    """
    if shards < 1:
        raise WeightstreamError(f"--expert-shards {shards}: give 1 or more shards")
    if how not in PLACEMENTS:
        raise WeightstreamError(f"--shard-placement {how}: one of {', '.join(PLACEMENTS)}")
    heat_of = _heat_of(heat)
    placement: list[list[Key]] = [[] for _ in range(shards)]
    ordered = sorted(keys)
    if how == "layers":
        for i, key in enumerate(ordered):
            placement[i * shards // len(ordered)].append(key)
    else:
        for layer in sorted({layer for layer, _ in ordered}):
            load = [(0.0, 0, i) for i in range(shards)]
            for key in sorted((k for k in ordered if k[0] == layer), key=lambda k: (-heat_of(k), k)):
                weight, count, i = min(load)
                placement[i].append(key)
                load[i] = (weight + heat_of(key), count + 1, i)
    return [sorted(keys_, key=lambda k: (-heat_of(k), k)) for keys_ in placement]


def copies(placement: Sequence[Sequence[Key]], n: int, heat: Mapping[Key, float] | None = None) -> list[list[Key]]:
    """Second copies of the `n` hottest keys of `placement` (by `heat`; none: all alike, the first keys): per shard,
    the copies it is offered after its own share, hottest first, each on the shard that holds the least heat of its
    layer among those without it (ties: the fewest experts, then the first), so a shard short of memory drops copies
    before its own experts. The head computes a key on its own shard while that is up, on a copy while it is not."""
    check_replicas(n, len(placement))
    heat_of = _heat_of(heat)
    out: list[list[Key]] = [[] for _ in placement]
    layer_heat: list[dict] = [{} for _ in placement]  # shard -> layer -> heat it holds
    owner = {}
    for i, keys in enumerate(placement):
        for key in keys:
            owner[key] = i
            layer_heat[i][key[0]] = layer_heat[i].get(key[0], 0.0) + heat_of(key)
    for key in sorted(owner, key=lambda k: (-heat_of(k), k))[:n]:
        i = min(
            (j for j in range(len(placement)) if j != owner[key]),
            key=lambda j: (layer_heat[j].get(key[0], 0.0), len(placement[j]) + len(out[j]), j),
        )
        out[i].append(key)
        layer_heat[i][key[0]] = layer_heat[i].get(key[0], 0.0) + heat_of(key)
    return out


def check_replicas(n: int, shards: int) -> None:
    """Refuses `--shard-replicas n` that is negative, or positive with fewer than 2 shards to hold a second copy."""
    if n < 0 or (n and shards < 2):
        raise WeightstreamError(
            f"--shard-replicas {n}: give 0 or more copies, and 2 or more shards to hold a second copy"
        )


def _heat_of(heat: Mapping[Key, float] | None):
    return lambda key: (heat or {}).get(key, 1.0 if heat is None else 0.0)


def heat_counts(choices: np.ndarray, layers: Sequence[int], n_experts: int) -> dict[tuple[int, int], float]:
    """(layer, expert) -> lookups in `choices` ([tokens, trace layers, k], -1 where none): `layers[i]` counted from
    the trace's layer i % (its layers), wrapping as replay does."""
    heat: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(layers):
        column = choices[:, i % choices.shape[1]].reshape(-1)
        counts = np.bincount(column[column >= 0], minlength=n_experts)[:n_experts]
        heat.update({(layer, e): float(c) for e, c in enumerate(counts)})
    return heat
