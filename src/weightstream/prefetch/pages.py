"""Per-page flags of one file (one byte per 4 KiB page): what we issued, fetched, dropped, what the loader read.

Interval lists were tried first; a loader whose threads read many tensors at once leaves tens of thousands of
holes, and keeping a sorted list of them cost seconds of CPU per GiB. A byte per page is 0.025% of the file.
"""

from __future__ import annotations

import numpy as np

from weightstream.units import PAGE

ISSUED, FETCHED, TOUCHED, DROPPED = 1, 2, 4, 8


class PageFlags:
    """Flags per page of a file of `size` bytes; ranges are byte ranges, rounded out to whole pages."""

    def __init__(self, size: int) -> None:
        self.flags = np.zeros(-(-size // PAGE), dtype=np.uint8)

    def _span(self, start: int, end: int) -> slice:
        return slice(max(0, start // PAGE), max(0, -(-end // PAGE)))

    def set(self, flag: int, start: int, end: int) -> None:
        """Set flag on the pages of [start, end)."""
        self.flags[self._span(start, end)] |= flag

    def count(self, start: int, end: int, have: int, lack: int = 0) -> int:
        """Bytes (whole pages) of [start, end) with every flag in `have` and none in `lack`."""
        f = self.flags[self._span(start, end)]
        return int(np.count_nonzero((f & (have | lack)) == have)) * PAGE

    def total(self, have: int, lack: int = 0) -> int:
        """Bytes of the whole file with every flag in `have` and none in `lack`."""
        return self.count(0, len(self.flags) * PAGE, have, lack)


class PageCounter:
    """How many bytes were read, and how many distinct pages, for a file whose size is not known upfront."""

    def __init__(self) -> None:
        self.seen = np.zeros(0, dtype=bool)
        self.total = 0

    def add(self, offset: int, length: int) -> None:
        """Count a read of [offset, offset + length)."""
        self.total += length
        end = -(-(offset + length) // PAGE)
        if end > len(self.seen):
            self.seen = np.concatenate([self.seen, np.zeros(max(end - len(self.seen), len(self.seen)), bool)])
        self.seen[offset // PAGE : end] = True

    @property
    def distinct(self) -> int:
        """Distinct bytes read (whole pages)."""
        return int(np.count_nonzero(self.seen)) * PAGE
