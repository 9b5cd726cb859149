"""Which expert shard holds which (layer, expert): the plan `generate --expert-shards` builds (engine/shards.py)
and `simulate --shards` prices (sim/cluster.py)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from weightstream.errors import WeightstreamError

PLACEMENTS = ("layers", "spread")

Key = tuple[int, Hashable]  # (layer, expert)


def place(
    keys: Sequence[Key],
    shards: int,
    heat: Mapping[Key, float] | None = None,
    how: str = "layers",
    replicas: int = 0,
) -> list[list[Key]]:
    """`keys` over `shards` lists, each in the order a shard keeps them: hottest by `heat` first (expected lookups;
    none: all alike), so that one short of memory drops the coldest.

    - layers: consecutive layers to each shard, as many experts each (a layer split at most between two): one round
      trip a layer, to one shard, mostly; for shards that share a machine's cores, or when the trip costs more than
      the compute it moves;
    - spread: each layer's experts over every shard, hottest first, each to the shard with the least heat of that
      layer so far (ties: the fewest experts, then the first shard): a layer's compute in parallel on every shard,
      for shards on machines of their own.

    `replicas`: the hottest that many keys get a second copy, each on the shard that holds the least heat of its layer
    among those without it (ties: the fewest experts, then the first), after that shard's own share (hottest first),
    so a shard keeps copies only in the room its share leaves; the head spreads a replicated expert's rows over the
    live copies and a shard's death leaves the other copy serving.
    """
    if shards < 1:
        raise WeightstreamError(f"--expert-shards {shards}: give 1 or more shards")
    if how not in PLACEMENTS:
        raise WeightstreamError(f"--shard-placement {how}: one of {', '.join(PLACEMENTS)}")
    if replicas < 0 or (replicas and shards < 2):
        raise WeightstreamError(
            f"--shard-replicas {replicas}: give 0 or more, and 2 or more --expert-shards for a second copy"
        )
    heat_of = lambda key: (heat or {}).get(key, 1.0 if heat is None else 0.0)
    hottest = lambda k: (-heat_of(k), k)
    placement: list[list[Key]] = [[] for _ in range(shards)]
    ordered = sorted(keys)
    if how == "layers":
        for i, key in enumerate(ordered):
            placement[i * shards // len(ordered)].append(key)
    else:
        for layer in sorted({layer for layer, _ in ordered}):
            load = [(0.0, 0, i) for i in range(shards)]
            for key in sorted((k for k in ordered if k[0] == layer), key=hottest):
                weight, count, i = min(load)
                placement[i].append(key)
                load[i] = (weight + heat_of(key), count + 1, i)
    placement = [sorted(keys_, key=hottest) for keys_ in placement]
    copies: list[list[Key]] = [[] for _ in range(shards)]
    layer_heat: list[dict] = [{} for _ in range(shards)]  # shard -> layer -> heat it holds
    owner = {}
    for i, keys_ in enumerate(placement):
        for key in keys_:
            owner[key] = i
            layer_heat[i][key[0]] = layer_heat[i].get(key[0], 0.0) + heat_of(key)
    for key in sorted(ordered, key=hottest)[:replicas]:
        i = min(
            (j for j in range(shards) if j != owner[key]),
            key=lambda j: (layer_heat[j].get(key[0], 0.0), len(placement[j]) + len(copies[j]), j),
        )
        copies[i].append(key)
        layer_heat[i][key[0]] = layer_heat[i].get(key[0], 0.0) + heat_of(key)
    return [own + extra for own, extra in zip(placement, copies)]


def heat_counts(choices: np.ndarray, layers: Sequence[int], n_experts: int) -> dict[tuple[int, int], float]:
    """(layer, expert) -> lookups in `choices` ([tokens, trace layers, k], -1 where none): `layers[i]` counted from
    the trace's layer i % (its layers), wrapping as replay does."""
    heat: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(layers):
        column = choices[:, i % choices.shape[1]].reshape(-1)
        counts = np.bincount(column[column >= 0], minlength=n_experts)[:n_experts]
        heat.update({(layer, e): float(c) for e, c in enumerate(counts)})
    return heat
