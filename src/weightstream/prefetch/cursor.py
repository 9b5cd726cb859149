"""Where one loader process is in its template: chunk states, what it has read, and the bookkeeping rules.

Pure state, no I/O and no locks (the Prefetcher holds its lock around every call), so every rule is tested
directly. The loader's position is counted, not taken from the furthest chunk it touched: after reading K
distinct chunks of its template it is taken to be at chunk K. Loaders do not read exactly in recorded order
(thread pools, a header read at the end of a file early on); one stray read far ahead must not abandon the
whole template, and here it moves the position by one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightstream.prefetch.plan import Chunk

PENDING, ISSUED, DONE, ABANDONED, CACHED, FAILED = range(6)
REWIND_CHUNKS = 4  # a thread missing this many chunks behind where it last read is making a new pass


@dataclass(slots=True)
class WorkerState:
    """One worker's chunks and progress. `ahead` deltas are returned to the caller, who sums all workers."""

    chunks: list[Chunk]
    no_burn: bool = False  # reads its data twice or keeps it mapped: burning after reading costs re-reads
    status: bytearray = field(default_factory=bytearray)
    touched: bytearray = field(default_factory=bytearray)  # the loader has read (part of) the chunk
    abandoned_once: bytearray = field(default_factory=bytearray)
    consumed: int = 0  # distinct chunks touched
    next_issue: int = 0
    next_reclaim: int = 0
    threads: dict = field(default_factory=dict)  # loader thread id -> last chunk index it read
    swept: int = 0  # touch_through has covered chunks before this
    done_at: list = field(default_factory=list)  # when each chunk's prefetch completed

    def __post_init__(self) -> None:
        n = len(self.chunks)
        self.status, self.touched, self.abandoned_once = bytearray(n), bytearray(n), bytearray(n)
        self.done_at = [0.0] * n

    @property
    def cursor(self) -> int:
        """Index of the chunk the loader is taken to have reached (-1: not started)."""
        return self.consumed - 1

    @property
    def position(self) -> int:
        """Template bytes before the end of the cursor's chunk."""
        c = self.chunks[self.cursor] if self.cursor >= 0 else None
        return c.position + c.length if c else 0

    def next_pending(self) -> Chunk | None:
        """The next chunk to issue, skipping those issued, read by the loader or given up."""
        while self.next_issue < len(self.chunks) and self.status[self.next_issue] != PENDING:
            self.next_issue += 1
        return self.chunks[self.next_issue] if self.next_issue < len(self.chunks) else None

    def issue(self, i: int) -> int:
        """Hand chunk i to a thread; returns the change in bytes ahead."""
        assert self.status[i] == PENDING, (i, self.status[i])
        self.status[i] = ISSUED
        self.next_issue = i + 1
        return self.chunks[i].length

    def complete(self, i: int, outcome: int, now: float = 0.0) -> int:
        """A thread finished chunk i (DONE, CACHED or FAILED) at time now; returns the change in bytes ahead."""
        assert self.status[i] == ISSUED and outcome in (DONE, CACHED, FAILED), (i, self.status[i], outcome)
        self.status[i] = outcome
        self.done_at[i] = now
        # Only DONE pages sit in memory waiting for the loader; the others were never ours to count.
        return -self.chunks[i].length if outcome != DONE and not self.touched[i] else 0

    def touch(self, i: int) -> tuple[int, int]:
        """The loader read chunk i; returns (change in bytes ahead, bytes newly abandoned)."""
        if self.touched[i]:
            return 0, 0
        self.touched[i] = 1
        self.consumed += 1
        delta = -self.chunks[i].length if self.status[i] in (ISSUED, DONE) else 0
        abandoned = self._abandon(i) if self.status[i] == PENDING else 0
        for j in range(self.next_issue, min(self.cursor + 1, len(self.chunks))):  # the loader is past them
            if self.status[j] == PENDING:
                abandoned += self._abandon(j)
        return delta, abandoned

    def touch_through(self, i: int) -> tuple[int, int]:
        """The loader is at chunk i and is taken to have read every chunk before it (used when only misses
        are visible: its reads of what we prefetched cannot be seen)."""
        delta = abandoned = 0
        for j in range(self.swept, i + 1):
            d, a = self.touch(j)
            delta, abandoned = delta + d, abandoned + a
        self.swept = max(self.swept, i + 1)
        return delta, abandoned

    def _abandon(self, i: int) -> int:
        self.status[i] = ABANDONED
        first, self.abandoned_once[i] = not self.abandoned_once[i], 1
        return self.chunks[i].length if first else 0

    def is_rewind(self, tid: int, i: int) -> bool:
        """Whether a miss by thread tid on chunk i means that thread started over: it misses on data already
        read, well behind where it last read. (Thread-pool loaders jump back to unread chunks all the time.)"""
        last = self.threads.get(tid)
        return bool(self.touched[i]) and last is not None and i < last - REWIND_CHUNKS

    def rewind(self, i: int) -> None:
        """Another pass from chunk i: later chunks are unread again, and may be prefetched again."""
        for j in range(i, len(self.chunks)):
            self.touched[j] = 0
            if self.status[j] in (DONE, CACHED, ABANDONED):
                self.status[j] = PENDING
        self.consumed = sum(self.touched)
        self.next_issue, self.swept = min(self.next_issue, i), min(self.swept, i)
        self.no_burn = True

    def in_flight_unread(self) -> int:
        """Bytes issued or prefetched and not yet read by the loader (to recount `ahead` after a rewind)."""
        return sum(
            c.length for c in self.chunks if self.status[c.index] in (ISSUED, DONE) and not self.touched[c.index]
        )

    def reclaimable(self, gap: int) -> list[Chunk]:
        """Chunks the loader read that now lie more than `gap` bytes behind it (never shared ones)."""
        if self.no_burn or self.cursor < 0:
            return []
        out, limit = [], self.position - gap
        while self.next_reclaim < len(self.chunks):
            c = self.chunks[self.next_reclaim]
            if c.position + c.length > limit:
                break
            if self.touched[c.index] and not c.shared:
                out.append(c)
            self.next_reclaim += 1
        return out
