"""More cache policies over expert keys, on the `policy.CachePolicy` contract, and `make_policy` to build any by name.

Belady's optimum needs the future, so it lives in ``weightstream.sim``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from weightstream.cache.policy import AllPinnedError, CachePolicy, Key, LRUPolicy
from weightstream.errors import WeightstreamError

ALL_PINNED = "every resident expert is pinned; the cache is below one layer's working set"


class SLRUPolicy:
    """Segmented LRU: misses enter probation, a hit promotes to a protected segment capped at a share of slots."""

    name = "slru"

    def __init__(self, capacity: int, protected_share: float = 0.5):
        assert capacity >= 1 and 0.0 <= protected_share <= 1.0, (capacity, protected_share)
        self.capacity = capacity
        self.protected_capacity = int(capacity * protected_share)
        self._probation: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def on_hit(self, key: Key) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        del self._probation[key]
        self._protected[key] = None
        if len(self._protected) > self.protected_capacity:  # demote protected's oldest to probation's newest
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def on_insert(self, key: Key) -> None:
        assert key not in self and len(self) < self.capacity, key
        self._probation[key] = None

    def on_read_ahead(self, key: Key) -> None:
        """A guess enters probation at its cold end."""
        self.on_insert(key)
        self._probation.move_to_end(key, last=False)

    def evict(self, pinned: set[Key]) -> Key:
        """Oldest unpinned probation entry; protected's oldest only when all of probation is pinned."""
        for segment in (self._probation, self._protected):
            for key in segment:
                if key not in pinned:
                    del segment[key]
                    return key
        raise AllPinnedError(ALL_PINNED)


class LFUPolicy:
    """Least frequently used since insertion (count restarts when evicted); ties go to the least recent."""

    name = "lfu"

    def __init__(self, capacity: int):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._rank: dict[Key, tuple[int, int]] = {}  # key -> (hits since insert + 1, tick of last access)
        self._heap: list[tuple[int, int, Key]] = []  # may hold stale ranks; checked against _rank on pop
        self._tick = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def _touch(self, key: Key, freq: int) -> None:
        self._tick += 1
        self._rank[key] = (freq, self._tick)
        heapq.heappush(self._heap, (freq, self._tick, key))
        if len(self._heap) > 4 * len(self._rank) + 64:  # drop stale entries so the heap stays O(capacity)
            self._heap = [(f, t, k) for k, (f, t) in self._rank.items()]
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._touch(key, self._rank[key][0] + 1)

    def on_insert(self, key: Key) -> None:
        assert key not in self._rank and len(self._rank) < self.capacity, key
        self._touch(key, 1)

    def on_read_ahead(self, key: Key) -> None:
        """A guess counts zero uses, below every looked-up expert; its first lookup makes it one."""
        assert key not in self._rank and len(self._rank) < self.capacity, key
        self._touch(key, 0)

    def evict(self, pinned: set[Key]) -> Key:
        """Lowest (count, last access) among unpinned entries."""
        skipped = []
        try:
            while self._heap:
                freq, tick, key = heapq.heappop(self._heap)
                if self._rank.get(key) != (freq, tick):
                    continue
                if key in pinned:
                    skipped.append((freq, tick, key))
                    continue
                del self._rank[key]
                return key
            raise AllPinnedError(ALL_PINNED)
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)


class PinnedPolicy:
    """A fixed set of experts stays once loaded; every other expert passes through LRU scratch slots."""

    name = "pinned"

    def __init__(self, capacity: int, pinned_keys: Iterable[Key]):
        self.static = frozenset((int(layer), int(expert)) for layer, expert in pinned_keys)
        assert capacity >= 1 and len(self.static) < capacity, (capacity, len(self.static))
        self.capacity = capacity
        self._static_resident: set[Key] = set()
        self._scratch: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._static_resident or key in self._scratch

    def __len__(self) -> int:
        return len(self._static_resident) + len(self._scratch)

    def on_hit(self, key: Key) -> None:
        if key in self._scratch:
            self._scratch.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        assert key not in self and len(self) < self.capacity, key
        if key in self.static:
            self._static_resident.add(key)
        else:
            self._scratch[key] = None

    def on_read_ahead(self, key: Key) -> None:
        """A guess outside the pinned set enters scratch at its cold end."""
        self.on_insert(key)
        if key in self._scratch:
            self._scratch.move_to_end(key, last=False)

    def evict(self, pinned: set[Key]) -> Key:
        """Oldest unpinned scratch entry; pinned-set experts are never evicted."""
        for key in self._scratch:
            if key not in pinned:
                del self._scratch[key]
                return key
        raise AllPinnedError(ALL_PINNED)


class AdaptivePolicy:
    """LRU while slots are below `threshold` x one token's working set, SLRU at or above it (decided once)."""

    name = "adaptive"

    def __init__(self, capacity: int, working_set_slots: int, threshold: float = 1.8, protected_share: float = 0.5):
        assert capacity >= 1 and working_set_slots >= 1, (capacity, working_set_slots)
        self.capacity = capacity
        self.ratio = capacity / working_set_slots
        self.threshold = threshold
        self.inner = LRUPolicy(capacity) if self.ratio < threshold else SLRUPolicy(capacity, protected_share)
        self.chosen = self.inner.name

    def __contains__(self, key: Key) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def on_hit(self, key: Key) -> None:
        self.inner.on_hit(key)

    def on_insert(self, key: Key) -> None:
        self.inner.on_insert(key)

    def on_read_ahead(self, key: Key) -> None:
        self.inner.on_read_ahead(key)

    def evict(self, pinned: set[Key]) -> Key:
        """The chosen inner policy's victim."""
        return self.inner.evict(pinned)


class ByteBudget:
    """Hold at most `budget_bytes` of experts whose size depends on their layer; eviction is the inner policy's."""

    def __init__(self, inner, budget_bytes: int, layer_bytes: Mapping[int, int]):
        self.inner, self.budget_bytes, self.layer_bytes = inner, budget_bytes, dict(layer_bytes)
        self.name, self.capacity, self.used_bytes = inner.name, inner.capacity, 0

    def __contains__(self, key: Key) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def needs_room(self, key: Key) -> bool:
        """True while inserting `key` would overrun the byte budget or the inner policy's entry count."""
        return self.used_bytes + self.layer_bytes[key[0]] > self.budget_bytes or len(self.inner) >= self.capacity

    def on_hit(self, key: Key) -> None:
        self.inner.on_hit(key)

    def on_insert(self, key: Key) -> None:
        self.inner.on_insert(key)
        self.used_bytes += self.layer_bytes[key[0]]

    def evict(self, pinned: set[Key]) -> Key:
        """The inner policy's victim, releasing its bytes."""
        victim = self.inner.evict(pinned)
        self.used_bytes -= self.layer_bytes[victim[0]]
        return victim


POLICY_OPTIONS = {
    "lru": set(),
    "slru": {"protected_share"},
    "lfu": set(),
    "pinned": {"pinned_keys"},
    "adaptive": {"threshold", "protected_share"},
}
POLICY_NAMES = tuple(POLICY_OPTIONS)


def make_policy(name: str, capacity_slots: int, working_set_slots: int | None = None, **opts) -> CachePolicy:
    """Build a runtime policy by name: lru, slru (protected_share), lfu, pinned (pinned_keys), adaptive (threshold)."""
    if name == "belady":
        raise WeightstreamError(
            "policy 'belady' needs the future and exists only in the simulator "
            "(weightstream simulate / weightstream.sim.replay)"
        )
    if name not in POLICY_OPTIONS:
        raise WeightstreamError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    if set(opts) - POLICY_OPTIONS[name]:
        raise WeightstreamError(f"policy {name!r} does not take option(s) {sorted(set(opts) - POLICY_OPTIONS[name])}")
    if capacity_slots < 1:
        raise WeightstreamError(f"a {name} cache needs at least one slot, got {capacity_slots}")
    share = opts.get("protected_share", 0.5)
    if not 0.0 <= share <= 1.0:
        raise WeightstreamError(f"protected_share must be within 0..1, got {share}")
    if name == "pinned":
        if "pinned_keys" not in opts:
            raise WeightstreamError(
                "policy 'pinned' needs pinned_keys (the experts to keep); the simulator picks "
                "them from the most frequent experts of a training share of a trace"
            )
        keys = {(int(layer), int(expert)) for layer, expert in opts["pinned_keys"]}
        if len(keys) >= capacity_slots:
            raise WeightstreamError(
                f"policy 'pinned': {len(keys)} pinned experts leave no free slot in a cache of {capacity_slots}; "
                "pin fewer or use a bigger cache"
            )
        return PinnedPolicy(capacity_slots, keys)
    if name == "adaptive":
        if not working_set_slots:
            raise WeightstreamError("policy 'adaptive' needs working_set_slots (experts one token uses, all layers)")
        return AdaptivePolicy(capacity_slots, working_set_slots, opts.get("threshold", 1.8), share)
    if name == "slru":
        return SLRUPolicy(capacity_slots, share)
    return LFUPolicy(capacity_slots) if name == "lfu" else LRUPolicy(capacity_slots)
