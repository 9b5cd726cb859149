"""Belady's optimum as a policy object on the shared contract (simulation only: it reads the future)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from weightstream.cache.policy import Key


class BeladyPolicy:
    """Evict the unpinned resident expert whose next use lies farthest ahead (never again = farthest)."""

    name = "belady"

    def __init__(self, capacity: int, access_keys: Sequence[Key], next_use: Sequence[int]):
        assert capacity >= 1 and len(access_keys) == len(next_use), capacity
        self.capacity = capacity
        self._keys, self._next_use = access_keys, next_use
        self._cursor = 0  # index of the access being served, in replay order
        self._next: dict[Key, int] = {}  # resident key -> position of its next use
        self._heap: list[tuple[int, Key]] = []  # (-next use, key); stale entries are skipped

    def __contains__(self, key: Key) -> bool:
        return key in self._next

    def __len__(self) -> int:
        return len(self._next)

    def _advance(self, key: Key) -> None:
        # access_layer calls on_hit or on_insert exactly once per access, in trace order: that is our clock.
        assert self._keys[self._cursor] == key, (self._cursor, self._keys[self._cursor], key)
        upcoming = int(self._next_use[self._cursor])
        self._cursor += 1
        self._next[key] = upcoming
        heapq.heappush(self._heap, (-upcoming, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(-n, k) for k, n in self._next.items()]
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._advance(key)

    def on_insert(self, key: Key) -> None:
        assert key not in self._next and len(self._next) < self.capacity, key
        self._advance(key)

    def evict(self, pinned: set[Key]) -> Key:
        """Unpinned resident key with the farthest next use."""
        skipped = []
        try:
            while self._heap:
                neg, key = heapq.heappop(self._heap)
                if self._next.get(key) != -neg:
                    continue
                if key in pinned:
                    skipped.append((neg, key))
                    continue
                del self._next[key]
                return key
            raise RuntimeError("every resident expert is pinned; the cache is below one layer's working set")
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)
