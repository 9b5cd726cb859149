"""Interruptible prefetch: threads read each worker's plan ahead of the loader's cursor, within a budget.

The cursor of a worker is the furthest chunk the loader has read (a fault or read() call, cached or not, from
tracefs). Misses alone do not move it: a loader's own readahead or madvise(WILLNEED) misses far ahead of what
it consumes, and following those would abandon and reclaim what it still needs. A thread that misses far
behind where it last read makes another pass: the cursor rewinds, and that worker no longer burns after
reading (what lies behind the cursor was evidently not consumed). Reclaim stays behind the slowest recently
active loader thread. Residency sampling sees only misses (and no threads), so there they move the cursor. Chunks not yet issued when the cursor passes them are abandoned; chunks prefetched and not yet passed
are "ahead" and count against the memory budget; with a budget, chunks more than the reclaim gap behind the
cursor are dropped from the page cache (burn after reading). When the loader misses on pages we had
prefetched and it had not read yet, the kernel evicted them: the budget halves, since reading further ahead
then only feeds reclaim. The loader's own reads are never touched:
prefetch only ever adds or drops clean page-cache pages, which the kernel re-reads from the file on demand.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from weightstream.prefetch import fetch as io
from weightstream.prefetch.events import MISS, READ, PageEvent, ReadSpans
from weightstream.prefetch.intervals import IntervalSet
from weightstream.prefetch.memory import headroom
from weightstream.prefetch.numa import bind_current_thread
from weightstream.prefetch.plan import Chunk, Plan
from weightstream.prefetch.settings import Counters, Settings

PENDING, ISSUED, DONE, ABANDONED, CACHED, FAILED = range(6)
PRESSURE_CHECK_S = 0.1
TIMELINE_POINTS = 20000
REWIND_CHUNKS = 4  # a thread missing this many chunks behind where it read is on a new pass
ACTIVE_S = 1.0  # a loader thread seen within this long still reads: reclaim stays behind it


@dataclass(slots=True)
class _Worker:
    chunks: list[Chunk]
    status: bytearray
    cursor: int = -1
    next_issue: int = 0
    next_reclaim: int = 0
    threads: dict = field(default_factory=dict)  # loader thread id -> (last chunk it read, when)
    multi_pass: bool = False  # seen reading data again: no more burn-after-reading for this worker
    abandoned_once: bytearray = field(default_factory=bytearray)


class Prefetcher:
    """Owns the prefetch threads and the per-worker cursors; fed by an event source's callback."""

    def __init__(self, plan: Plan, paths: list[str], ids: list[tuple[int, int]], settings: Settings) -> None:
        self.plan, self.settings, self.counters = plan, settings, Counters()
        self.file_of = {ident: i for i, ident in enumerate(ids)}  # (st_dev, inode) -> file number
        self.workers = [_Worker(c, bytearray(len(c)), multi_pass=multi, abandoned_once=bytearray(len(c)))
                        for c, multi in zip(plan.workers, plan.multi_pass or [False] * len(plan.workers))]
        self.ahead = 0
        self.fetched = [IntervalSet() for _ in paths]  # completed prefetch reads
        self.issued = [IntervalSet() for _ in paths]  # every range handed to a thread, at hand-off
        self.own_misses_visible = False  # residency sampling also sees our reads: skip misses we issued
        self.touched = [IntervalSet() for _ in paths]
        self.dropped = [IntervalSet() for _ in paths]
        self._fds = [io.open_for_prefetch(p) for p in paths]
        self._cond = threading.Condition()
        self._stop = False
        self._go = threading.Event()
        self._pressure_at, self._pressured = 0.0, False
        self._rr = 0
        self._t0 = time.monotonic()
        self._spans = ReadSpans()
        self.budget = settings.budget  # shrinks when the kernel evicts what we prefetched before it is used
        self._shrunk_at = 0.0
        self._threads = [threading.Thread(target=self._run, name=f"ws-prefetch-{i}", daemon=True)
                         for i in range(max(1, settings.threads))]
        for t in self._threads:
            t.start()

    @property
    def thread_ids(self) -> list[int]:
        """Kernel thread ids of the prefetch threads (to keep them out of the loader's events)."""
        return [t.native_id for t in self._threads]

    def go(self) -> None:
        """Start prefetching."""
        self._go.set()

    def stop(self) -> None:
        """Stop: in-flight chunks finish (one chunk each), then threads exit and are joined; fds closed."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._go.set()
        for t in self._threads:
            t.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # --- prefetch threads -------------------------------------------------------------------------------
    def _run(self) -> None:
        self._go.wait()
        bind_current_thread(self.settings.placement)
        while True:
            with self._cond:
                chunk = self._next_chunk()
                while chunk is None and not self._stop:  # idle until stopped: a rewind may bring work back
                    self._cond.wait(PRESSURE_CHECK_S)
                    chunk = self._next_chunk()
                if chunk is None:
                    return
            self._complete(chunk, *self._fetch(chunk))

    def _fetch(self, chunk: Chunk) -> tuple[list[tuple[int, int]] | None, int]:
        try:
            return io.fetch(self._fds[chunk.file], chunk.offset, chunk.length)
        except OSError:
            return None, 0  # a short or failing file: skip the chunk; the loader sees the file as it is

    def _next_chunk(self) -> Chunk | None:
        """Under the lock: the next chunk to issue, round-robin over workers, within budget and headroom."""
        if self._stop or self._under_pressure():
            return None
        for k in range(len(self.workers)):
            w = self.workers[(self._rr + k) % len(self.workers)]
            while w.next_issue < len(w.chunks) and w.status[w.next_issue] != PENDING:
                w.next_issue += 1
            if w.next_issue >= len(w.chunks):
                continue
            chunk = w.chunks[w.next_issue]
            budget = self.budget
            if budget is not None and self.ahead > 0 and self.ahead + chunk.length > budget:
                continue
            w.status[chunk.index] = ISSUED
            self.issued[chunk.file].add(chunk.offset, chunk.offset + chunk.length)
            w.next_issue += 1
            self.ahead += chunk.length
            self.counters.peak_ahead = max(self.counters.peak_ahead, self.ahead)
            self._rr += 1
            return chunk
        return None

    def _under_pressure(self) -> bool:
        now = time.monotonic()
        if now - self._pressure_at >= PRESSURE_CHECK_S:
            was, self._pressure_at = self._pressured, now
            self._pressured = headroom(self.settings.cgroup) < self.settings.pressure_floor
            self.counters.pressure_pauses += self._pressured and not was
        return self._pressured

    def _complete(self, chunk: Chunk, runs: list[tuple[int, int]] | None, cached: int) -> None:
        with self._cond:
            w = self.workers[chunk.worker]
            ahead = chunk.index > w.cursor
            if runs is None:
                w.status[chunk.index] = FAILED
                self.counters.failed_chunks += 1
            else:
                w.status[chunk.index] = DONE if runs else CACHED
                self.counters.already_cached += cached
                for start, end in runs:
                    self.counters.prefetched += end - start
                    self.fetched[chunk.file].add(start, end)
            if ahead and w.status[chunk.index] != DONE:
                self.ahead -= chunk.length  # nothing was added to memory after all
            self._cond.notify_all()

    # --- loader events --------------------------------------------------------------------------------
    def on_events(self, events: list[PageEvent]) -> None:
        """Move cursors to where the loader is; account misses, re-reads; then burn what is far behind."""
        with self._cond:
            for e in events:
                self._note(e)
            burn = self.settings.budget is not None and self.settings.reclaim_gap is not None
            todo = self._reclaimable() if burn else []
            self._cond.notify_all()
        for chunk in todo:
            if self._stop:
                return
            dropped = io.reclaim(self._fds[chunk.file], chunk.offset, chunk.length)
            with self._cond:
                self.counters.reclaimed += dropped
                if dropped:
                    self.dropped[chunk.file].add(chunk.offset, chunk.offset + chunk.length)

    def _note(self, e: PageEvent) -> None:
        f = self.file_of.get((e.dev, e.ino))
        if f is None:
            return
        start, end = io.page_span(e.offset, e.length)
        if e.kind == MISS and not self._count_miss(f, start, end):
            return
        self.counters.events += 1
        if e.kind == READ:  # the position being read; what was read becomes known step by step
            for s, t in self._spans.feed(e):
                self.touched[f].add(s, t)
            start, end = io.page_span(e.offset, 1)
        else:
            self.touched[f].add(start, end)
        moves = e.kind != MISS or self.own_misses_visible
        now = time.monotonic()
        for chunk in self.plan.lookup(f, start, end):
            w = self.workers[chunk.worker]
            last = w.threads.get(e.tid)
            if e.kind == MISS and last is not None and chunk.index < last[0] - REWIND_CHUNKS:
                self._rewind(w, chunk.index)
            if moves:
                w.threads[e.tid] = (chunk.index, now)
                self._advance(w, chunk.index)

    def _count_miss(self, f: int, start: int, end: int) -> bool:
        """Account a miss; False when it was our own read (residency sampling sees those too)."""
        if self.own_misses_visible and self.issued[f].overlap(start, end) == end - start:
            return False
        self.counters.loader_missed += end - start
        dropped = self.dropped[f].overlap(start, end)
        self.counters.reread_after_reclaim += dropped
        lost = self.fetched[f].overlap(start, end) - self.touched[f].overlap(start, end) - dropped
        if lost > 0:
            self._evicted_before_use(lost)
        return True

    def _evicted_before_use(self, lost: int) -> None:
        """Memory pressure, measured: the kernel dropped pages we read before the loader got to them. Halve
        the budget (at most every 100 ms), down to two chunks: reading further ahead only feeds reclaim."""
        self.counters.evicted_before_use += lost
        now = time.monotonic()
        if now - self._shrunk_at < PRESSURE_CHECK_S:
            return
        self._shrunk_at = now
        current = self.budget if self.budget is not None else max(self.ahead, 2 * self.plan.chunk)
        self.budget = max(2 * self.plan.chunk, current // 2)

    def _rewind(self, w: _Worker, index: int) -> None:
        """A loader thread missed far behind where it had read: another pass (after memory pressure evicted the
        first). Follow it back: everything after `index` may be prefetched again (cached chunks cost nothing)."""
        for i in range(index, len(w.chunks)):
            if w.status[i] in (DONE, CACHED, ABANDONED):
                w.status[i] = PENDING
        w.cursor, w.next_issue = index, index + 1
        w.multi_pass = True  # it reads what it read before: burning after reading would cost re-reads
        self.counters.rewinds += 1
        self.ahead = sum(c.length for x in self.workers for c in x.chunks[x.cursor + 1:]
                         if x.status[c.index] == ISSUED)

    def _advance(self, w: _Worker, index: int) -> None:
        """The loader reached chunk `index`: abandon what was not issued before it, release its budget."""
        for i in range(w.cursor + 1, index + 1):
            status = w.status[i]
            if status == PENDING:
                w.status[i] = ABANDONED
                if not w.abandoned_once[i]:  # a rewind can re-arm and abandon a chunk again: count it once
                    w.abandoned_once[i] = 1
                    self.counters.abandoned += w.chunks[i].length
            elif status in (ISSUED, DONE):
                self.ahead -= w.chunks[i].length
        w.cursor = max(w.cursor, index)
        w.next_issue = max(w.next_issue, w.cursor + 1)
        if len(self.counters.timeline) < TIMELINE_POINTS:
            issue = w.chunks[min(w.next_issue, len(w.chunks) - 1)].position
            self.counters.timeline.append((round(time.monotonic() - self._t0, 3), self.workers.index(w),
                                           w.chunks[index].position, issue, self.ahead))

    def _reclaimable(self) -> list[Chunk]:
        out, recent = [], time.monotonic() - ACTIVE_S
        for w in self.workers:
            if w.cursor < 0 or w.multi_pass:
                continue
            # Behind the slowest thread still reading: threads of one loader often split each tensor.
            slowest = min((i for i, t in w.threads.values() if t >= recent), default=w.cursor)
            limit = w.chunks[slowest].position - self.settings.reclaim_gap
            while w.next_reclaim < len(w.chunks) and w.chunks[w.next_reclaim].position + \
                    w.chunks[w.next_reclaim].length <= limit:
                chunk = w.chunks[w.next_reclaim]
                if not chunk.shared:
                    out.append(chunk)
                w.next_reclaim += 1
        return out

    def used_bytes(self) -> int:
        """Prefetched bytes the loader then read (needs access events, i.e. tracefs)."""
        with self._cond:
            for _, ident, start, end in self._spans.flush():
                if ident in self.file_of:
                    self.touched[self.file_of[ident]].add(start, end)
            return sum(f.intersection_bytes(t) for f, t in zip(self.fetched, self.touched))
