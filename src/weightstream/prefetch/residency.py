"""Page-cache misses without tracefs: a sampler of mincore(2) residency over the model files.

It needs no root. The sampler turns residency changes into MISS events: a page that was not cached at the
previous sample and is cached now was missed in between. Its precision is the sampling interval: the order
of misses inside one interval is lost (they are reported in file order), the process is unknown, and a page
cached and evicted inside one interval is not seen.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np

from weightstream.io.pagecache import resident_pages
from weightstream.prefetch.events import MISS, PageEvent
from weightstream.units import PAGE


class ResidencySampler:
    """Polls mincore over the model files and reports newly cached pages as MISS events."""

    def __init__(self, files: list[tuple[str, int, int]], interval_s: float = 0.02) -> None:
        self.files: list[tuple[str, int, int]] = []  # (path, st_dev, inode) being sampled
        self._pending = list(files)
        self._lock = threading.Lock()
        self.interval_s = interval_s
        self.samples = 0
        self.scan_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_files(self, files: list[tuple[str, int, int]]) -> None:
        """Sample more files from the next round on (what they hold cached by then is not a miss)."""
        with self._lock:
            self._pending += files

    def start(self, on_events: Callable[[list[PageEvent]], None]) -> None:
        """Take the first snapshot now (what is cached already is not a miss) and sample in a thread."""
        fds: list[int] = []
        before: list[np.ndarray] = []
        self._take_pending(fds, before)
        self._thread = threading.Thread(
            target=self._loop, args=(fds, before, on_events), name="ws-mincore", daemon=True
        )
        self._thread.start()

    def _take_pending(self, fds: list[int], before: list[np.ndarray]) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for path, dev, ino in pending:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            self.files.append((path, dev, ino))
            fds.append(fd)
            before.append(resident_pages(fd))

    def _loop(self, fds, before, on_events) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                self._take_pending(fds, before)
                t0 = time.perf_counter()
                events = []
                for i, fd in enumerate(fds):
                    now = resident_pages(fd)
                    events += self._new_pages(i, before[i], now)
                    before[i] = now
                self.samples += 1
                self.scan_s += time.perf_counter() - t0
                if events:
                    on_events(events)
                if stopping:
                    return
                # Sampling costs ~20 ms per GiB cached here: never spend more than a quarter of a core on it.
                self._stop.wait(max(self.interval_s, 3 * (time.perf_counter() - t0)))
        finally:
            for fd in fds:
                os.close(fd)

    def _new_pages(self, i: int, before: np.ndarray, now: np.ndarray) -> list[PageEvent]:
        _, dev, ino = self.files[i]
        new = np.flatnonzero(now & ~before)
        if new.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(new) != 1) + 1  # runs of consecutive pages become one event
        out = []
        for run in np.split(new, breaks):
            out.append(PageEvent(MISS, 0, 0, dev, ino, int(run[0]) * PAGE, int(run.size) * PAGE))
        return out

    @property
    def resolution_s(self) -> float:
        """The average time between samples: the order of misses within it is not known."""
        return max(self.interval_s, 4 * self.scan_s / max(1, self.samples))

    def stop(self) -> None:
        """Take a last sample and join the thread."""
        self._stop.set()
        if self._thread:
            self._thread.join()
