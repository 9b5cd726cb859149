"""Interruptible prefetch: threads read each worker's plan ahead of the loader, within a memory budget.

The loader's progress comes from the event source: reads (mmap faults, fault-around, read() steps, cached or
not) mark chunks as read, and the worker's position is the number of distinct chunks read (cursor.py says
why counting beats "furthest chunk"). Misses alone do not move it: a loader's own readahead or
madvise(WILLNEED) misses far ahead of what it consumes. A chunk the loader reads before we issued it is
abandoned; so are chunks it has counted past. "Ahead" is what we prefetched (or have in flight) that the
loader has not read yet, and it never exceeds the budget. With a budget, chunks the loader read that lie more
than the reclaim gap behind it are dropped from the page cache (burn after reading). A thread that misses far
behind where it last read makes another pass: the worker rewinds and no longer burns after reading. When the
loader misses on pages we prefetched and it had not read, the kernel evicted them: the budget halves.
Residency sampling sees only misses, so there misses count as reads.

The loader's own reads are never touched: prefetch only adds clean pages of the files to the page cache and
drops clean, unmapped ones; the kernel serves every read from the file itself.
"""

from __future__ import annotations

import os
import threading
import time

from weightstream.prefetch import fetch as io
from weightstream.prefetch.cursor import CACHED, DONE, FAILED, WorkerState
from weightstream.prefetch.events import MISS, READ, PageEvent, ReadSpans
from weightstream.prefetch.memory import under_pressure
from weightstream.prefetch.numa import bind_current_thread
from weightstream.prefetch.pages import DROPPED, FETCHED, ISSUED, TOUCHED, PageFlags
from weightstream.prefetch.plan import Chunk, Plan
from weightstream.prefetch.settings import Counters, Settings

PRESSURE_CHECK_S = 0.01  # memory is checked at most this often (three small procfs/cgroupfs reads)
SHRINK_EVERY_S = 0.1
IDLE_WAIT_S = 0.05
TIMELINE_POINTS = 20000
EVICTION_AGE_S = 0.5  # prefetched pages missed this long after we read them were evicted, not raced
BURN_RETRY_S = 1.0  # chunks still mapped when burnt are tried again when the loader changes file, or this often


class Prefetcher:
    """Owns the prefetch threads and the per-worker state; fed by an event source's callback."""

    def __init__(self, plan: Plan, paths: list[str], ids: list[tuple[int, int]], settings: Settings) -> None:
        self.plan, self.settings, self.counters = plan, settings, Counters()
        self.file_of = {ident: i for i, ident in enumerate(ids)}  # (st_dev, inode) -> file number
        multi = plan.no_burn or [False] * len(plan.workers)
        self.workers = [WorkerState(chunks, m) for chunks, m in zip(plan.workers, multi)]
        self.ahead = 0
        self.budget = settings.budget  # shrinks when the kernel evicts what we prefetched before it is used
        self.own_misses_visible = False  # residency sampling also sees our reads: skip misses we issued
        self._fds = [io.open_for_prefetch(p) for p in paths]
        self.pages = [PageFlags(os.fstat(fd).st_size) for fd in self._fds]  # issued/fetched/read/dropped
        self._cond = threading.Condition()
        self._stop, self._go = False, threading.Event()
        self._pressure_at, self._pressured, self._shrunk_at = 0.0, False, 0.0
        self._rr, self._t0 = 0, time.monotonic()
        self._spans = ReadSpans()
        self._unburnt: list[Chunk] = []  # read and due to burn, but mapped at the time: DONTNEED left them
        self._burn_files: tuple[int, ...] = ()  # the file each worker's cursor was in at the last retry
        self._burn_retry_at = 0.0
        self._threads = [
            threading.Thread(target=self._run, name=f"ws-prefetch-{i}", daemon=True)
            for i in range(max(1, settings.threads))
        ]
        for t in self._threads:
            t.start()

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
                    self._cond.wait(IDLE_WAIT_S)
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
            chunk = w.next_pending()
            if chunk is None:
                continue
            if self.budget is not None and self.ahead > 0 and self.ahead + chunk.length > self.budget:
                continue
            self.ahead += w.issue(chunk.index)
            self.pages[chunk.file].set(ISSUED, chunk.offset, chunk.offset + chunk.length)
            self.counters.peak_ahead = max(self.counters.peak_ahead, self.ahead)
            self._rr += 1
            return chunk
        return None

    def _under_pressure(self) -> bool:
        now = time.monotonic()
        if now - self._pressure_at >= PRESSURE_CHECK_S:
            was, self._pressure_at = self._pressured, now
            self._pressured = under_pressure(self.settings.cgroup, self.settings.pressure_floor)
            self.counters.pressure_pauses += self._pressured and not was
        return self._pressured

    def _complete(self, chunk: Chunk, runs: list[tuple[int, int]] | None, cached: int) -> None:
        with self._cond:
            outcome = FAILED if runs is None else (DONE if runs else CACHED)
            self.ahead += self.workers[chunk.worker].complete(chunk.index, outcome, time.monotonic())
            self.counters.failed_chunks += outcome == FAILED
            self.counters.already_cached += cached if runs is not None else 0
            for start, end in runs or ():
                self.counters.prefetched += end - start
                self.pages[chunk.file].set(FETCHED, start, end)
            self._cond.notify_all()

    # --- loader events --------------------------------------------------------------------------------
    def on_events(self, events: list[PageEvent]) -> None:
        """Note what the loader read and missed; then burn what lies far behind it."""
        with self._cond:
            for e in events:
                self._note(e)
            burn = self.settings.budget is not None and self.settings.reclaim_gap is not None
            todo = [c for w in self.workers for c in w.reclaimable(self.settings.reclaim_gap)] if burn else []
            todo += self._burn_retries() if burn else []
            self._cond.notify_all()
        for chunk in todo:
            if self._stop:
                return
            dropped, left = io.reclaim(self._fds[chunk.file], chunk.offset, chunk.length)
            with self._cond:
                self.counters.reclaimed += dropped
                if dropped:
                    self.pages[chunk.file].set(DROPPED, chunk.offset, chunk.offset + chunk.length)
                if left:  # still mapped (a loader that maps a shard drops it when done): try again later
                    if not self._unburnt:
                        self._burn_files, self._burn_retry_at = self._cursor_files(), time.monotonic()
                    self._unburnt.append(chunk)

    def _burn_retries(self) -> list[Chunk]:
        """Under the lock: the chunks left mapped at their burn, when a worker moved to another file (it
        likely unmapped the last) or BURN_RETRY_S has passed."""
        if not self._unburnt:
            return []
        files, now = self._cursor_files(), time.monotonic()
        if files == self._burn_files and now - self._burn_retry_at < BURN_RETRY_S:
            return []
        self._burn_files, self._burn_retry_at = files, now
        retry, self._unburnt = self._unburnt, []
        return retry

    def _cursor_files(self) -> tuple[int, ...]:
        return tuple(w.chunks[w.cursor].file if w.cursor >= 0 else -1 for w in self.workers)

    def _note(self, e: PageEvent) -> None:
        f = self.file_of.get((e.dev, e.ino))
        if f is None:
            return
        start, end = io.page_span(e.offset, e.length)
        if e.kind == MISS and not self._count_miss(f, start, end):
            return
        self.counters.events += 1
        if e.kind == READ:  # only the position being read; what was read becomes known step by step
            for s, t in self._spans.feed(e):
                self.pages[f].set(TOUCHED, s, t)
            start, end = io.page_span(e.offset, 1)
        elif e.kind != MISS:
            self.pages[f].set(TOUCHED, start, end)
        reads = e.kind != MISS or self.own_misses_visible
        for chunk in self.plan.lookup(f, start, end):
            w = self.workers[chunk.worker]
            if e.kind == MISS and w.is_rewind(e.tid, chunk.index):
                self._rewind(w, chunk.index)
            if reads:
                w.threads[e.tid] = chunk.index
                self._touch(w, chunk.index)

    def _touch(self, w: WorkerState, index: int) -> None:
        delta, abandoned = w.touch_through(index) if self.own_misses_visible else w.touch(index)
        self.ahead += delta
        self.counters.abandoned += abandoned
        if len(self.counters.timeline) < TIMELINE_POINTS:
            issue = w.chunks[min(w.next_issue, len(w.chunks) - 1)].position
            self.counters.timeline.append(
                (round(time.monotonic() - self._t0, 3), self.workers.index(w), w.position, issue, self.ahead)
            )

    def _count_miss(self, f: int, start: int, end: int) -> bool:
        """Account a miss; False when it was our own read (residency sampling sees those too)."""
        pages = self.pages[f]
        if self.own_misses_visible and pages.count(start, end, 0, ISSUED) == 0:
            return False
        self.counters.loader_missed += end - start
        self.counters.reread_after_reclaim += pages.count(start, end, DROPPED)
        lost = pages.count(start, end, FETCHED, TOUCHED | DROPPED)  # ours, unread, and not dropped by us
        if lost > 0:
            self.counters.evicted_before_use += lost
            # A miss right after our read of the same pages is a race with the loader's own readahead;
            # only pages that sat in memory a while and are gone show that the kernel is evicting them.
            aged = time.monotonic() - EVICTION_AGE_S
            if any(
                self.workers[c.worker].status[c.index] == DONE and self.workers[c.worker].done_at[c.index] < aged
                for c in self.plan.lookup(f, start, end)
            ):
                self._shrink_budget()
        return True

    def _shrink_budget(self) -> None:
        """Memory pressure, measured: the kernel dropped pages we read before the loader got to them. Halve
        the budget (at most every 100 ms), down to two chunks: reading further ahead only feeds reclaim."""
        now = time.monotonic()
        if now - self._shrunk_at < SHRINK_EVERY_S:
            return
        self._shrunk_at = now
        current = self.budget if self.budget is not None else max(self.ahead, 2 * self.plan.chunk)
        self.budget = max(2 * self.plan.chunk, current // 2)

    def _rewind(self, w: WorkerState, index: int) -> None:
        w.rewind(index)
        self.counters.rewinds += 1
        self.ahead = sum(x.in_flight_unread() for x in self.workers)

    def used_bytes(self) -> int:
        """Prefetched bytes the loader then read (needs access events, i.e. tracefs)."""
        with self._cond:
            for _, ident, start, end in self._spans.flush():
                if ident in self.file_of:
                    self.pages[self.file_of[ident]].set(TOUCHED, start, end)
            return sum(p.total(FETCHED | TOUCHED) for p in self.pages)
