"""Page-cache residency without tracefs: cachestat(2) counts, mincore(2) bitmaps, and dropping a file's pages.

These need no root. The sampler turns residency changes into MISS events: a page that was not cached at the
previous sample and is cached now was missed in between. Its precision is the sampling interval: the order
of misses inside one interval is lost (they are reported in file order), the process is unknown, and a page
cached and evicted inside one interval is not seen.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable

import numpy as np

from weightstream.prefetch.events import MISS, PageEvent
from weightstream.prefetch.units import PAGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long
_SYS_CACHESTAT = 451  # same number on x86-64 and arm64 (asm-generic)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_bytes(fd: int, offset: int = 0, length: int = 0) -> int:
    """Bytes of [offset, offset+length) in the page cache (length 0: to the end), by cachestat(2)."""
    rng, st = _Range(offset, length), _Stat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
        return st.cache * PAGE
    return int(resident_pages(fd, offset, length).sum()) * PAGE  # kernels before 6.5: mincore


def resident_pages(fd: int, offset: int = 0, length: int = 0) -> np.ndarray:
    """A 0/1 vector, one entry per page of [offset, offset+length), by mmap + mincore(2)."""
    size = os.fstat(fd).st_size
    length = (length or size - offset) if offset < size else 0
    n = -(-length // PAGE)
    vec = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return vec
    addr = _libc.mmap(None, length, 1, 1, fd, offset)  # PROT_READ, MAP_SHARED; offset is page aligned
    if addr in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap for mincore failed")
    try:
        if _libc.mincore(addr, length, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        _libc.munmap(addr, length)
    return vec & 1


def drop_cache(path: str) -> int:
    """Evict a file's unmapped pages (POSIX_FADV_DONTNEED); returns bytes still cached afterwards."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # DONTNEED skips dirty pages: a freshly written checkpoint must reach the disk first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return cached_bytes(fd)
    finally:
        os.close(fd)


def drop_all_caches() -> str:
    """Write 1 to /proc/sys/vm/drop_caches when permitted; returns what happened, in words."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "dropped the whole page cache (/proc/sys/vm/drop_caches)"
    except OSError as exc:
        return f"/proc/sys/vm/drop_caches refused ({exc.strerror}); dropped per file only"


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
        self._thread = threading.Thread(target=self._loop, args=(fds, before, on_events), name="ws-mincore",
                                        daemon=True)
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
