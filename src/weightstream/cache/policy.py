"""Cache policies over expert keys, shared by the simulator and the runtime expert cache.

A policy is pure bookkeeping over keys ``(layer, expert)``: it knows nothing of bytes, slots or threads.
The one place that decides hits, misses and victims is :func:`access_layer`; the simulator and
``ExpertCache`` both call it, so they cannot disagree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

Key = tuple[int, int]  # (layer, expert)


class CachePolicy(Protocol):
    """What `access_layer` (and so the runtime cache and the simulator) needs of a policy.

    Optional, looked up by name: `needs_room(key)` when entries differ in size (`policies.ByteBudget`), and
    `on_read_ahead(key)` to insert a guessed expert where a wrong guess is evicted first.
    """

    name: str
    capacity: int  # slots

    def __contains__(self, key: Key) -> bool: ...

    def __len__(self) -> int: ...

    def on_hit(self, key: Key) -> None: ...

    def on_insert(self, key: Key) -> None:
        """Only called when there is room."""

    def evict(self, pinned: set[Key]) -> Key:
        """Remove and return the victim, never a key of `pinned`; AllPinnedError when every key is pinned."""


class AllPinnedError(RuntimeError):
    """No resident expert may be evicted: every one is pinned (a read-ahead then simply stops)."""


class LRUPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self, capacity: int):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        assert key not in self._order and len(self._order) < self.capacity, key
        self._order[key] = None

    def on_read_ahead(self, key: Key) -> None:
        """Insert a guessed expert at the cold end: unless a lookup finds it first, it is the next victim."""
        self.on_insert(key)
        self._order.move_to_end(key, last=False)

    def evict(self, pinned: set[Key]) -> Key:
        """Remove and return the victim, never one of ``pinned``."""
        for key in self._order:
            if key not in pinned:
                del self._order[key]
                return key
        raise AllPinnedError("every resident expert is pinned; the cache is below one layer's working set")


@dataclass(slots=True)
class LayerAccess:
    """Outcome of one layer's lookups: which keys hit, which missed, and what each miss evicted."""

    hits: list[Key]
    misses: list[Key]
    evicted: list[Key]


def _needs_room(policy: CachePolicy, key: Key) -> bool:
    # Optional hook for byte budgets (experts of different sizes); slot-counted policies need none.
    hook = getattr(policy, "needs_room", None)
    return hook(key) if hook is not None else len(policy) >= policy.capacity


def access_layer(
    policy: CachePolicy, layer: int, experts: Iterable[int], pinned: set[Key] | None = None
) -> LayerAccess:
    """Look up one layer's chosen experts in order; the layer's own experts are never evicted for each other."""
    keys = [(layer, int(e)) for e in experts]
    pin = set(keys) if pinned is None else pinned | set(keys)
    out = LayerAccess([], [], [])
    for key in keys:
        if key in policy:
            policy.on_hit(key)
            out.hits.append(key)
            continue
        while _needs_room(policy, key):
            out.evicted.append(policy.evict(pin))
        policy.on_insert(key)
        out.misses.append(key)
    return out


def insert_read_ahead(policy: CachePolicy, key: Key) -> None:
    """Insert a predicted (not yet looked-up) expert; policies without `on_read_ahead` treat it as a miss."""
    getattr(policy, "on_read_ahead", policy.on_insert)(key)


def wave_positions(experts: Sequence[int], capacity: int) -> list[list[int]]:
    """Cut one layer's lookups into waves of at most `capacity` distinct experts: the positions (into `experts`) each
    wave looks up.

    A decode step is one wave. A batched prefill step can route to more experts than the cache holds; its experts
    join waves in the order they first appear, `capacity` to a wave, and a wave holds every lookup of its experts
    (in their order), so each expert is looked up, read and computed in one wave and never again in the step. Each
    wave is looked up, computed and unpinned before the next, so the runtime and the simulator agree on what is
    pinned when.
    """
    rank: dict[int, int] = {}
    for e in experts:
        rank.setdefault(int(e), len(rank))
    waves: list[list[int]] = [[] for _ in range(-(-len(rank) // capacity))]
    for i, e in enumerate(experts):
        waves[rank[int(e)] // capacity].append(i)
    return waves


def split_waves(experts: Sequence[int], capacity: int) -> list[list[int]]:
    """The experts each wave of `wave_positions` looks up, in lookup order."""
    return [[int(experts[i]) for i in wave] for wave in wave_positions(experts, capacity)]
