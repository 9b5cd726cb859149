"""A set of byte intervals [start, end) with merging, for accounting what was read, used and reclaimed."""

from __future__ import annotations

import bisect


class IntervalSet:
    """Disjoint, sorted half-open intervals; adding merges overlapping or touching ones."""

    __slots__ = ("_starts", "_ends")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        """Add [start, end)."""
        if end <= start:
            return
        lo = bisect.bisect_left(self._ends, start)  # first interval that ends at or after start
        hi = bisect.bisect_right(self._starts, end)  # intervals starting at or before end touch us
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def overlap(self, start: int, end: int) -> int:
        """Bytes of [start, end) covered by the set."""
        total = 0
        i = bisect.bisect_right(self._ends, start)
        while i < len(self._starts) and self._starts[i] < end:
            total += min(end, self._ends[i]) - max(start, self._starts[i])
            i += 1
        return total

    def intersection_bytes(self, other: "IntervalSet") -> int:
        """Bytes covered by both sets."""
        return sum(other.overlap(s, e) for s, e in zip(self._starts, self._ends))

    def __iter__(self):
        return iter(zip(self._starts, self._ends))

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def total(self) -> int:
        """Bytes covered."""
        return sum(e - s for s, e in zip(self._starts, self._ends))
