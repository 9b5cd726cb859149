"""The I/O a prefetch thread does: bring a range into the page cache, or drop it again.

readahead(2) queues the reads without copying anything to user space (a pread into a buffer cost us ~3x the
CPU); one-byte preads spread over the range then wait until the pages are filled, so a thread has one chunk
in flight at a time and the thread count is the I/O depth.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from weightstream.io.pagecache import cached_bytes, evict, resident_pages
from weightstream.units import PAGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.readahead.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_size_t]
_libc.readahead.restype = ctypes.c_ssize_t
_WAIT_STEP = 128 << 10


def open_for_prefetch(path: str) -> int:
    """Open read-only; POSIX_FADV_RANDOM so our reads fetch exactly the range, with no readahead beyond it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def fetch(fd: int, offset: int, length: int) -> tuple[list[tuple[int, int]], int]:
    """Bring [offset, offset+length) into the page cache; returns (the [start, end) runs that were not cached
    and are now, bytes that were already cached). offset is page aligned."""
    cached = cached_bytes(fd, offset, length)
    if cached >= length:
        return [], length
    runs = [(offset, offset + length)] if cached == 0 else _missing_runs(fd, offset, length)
    if _libc.readahead(fd, offset, length) != 0:
        _read_through(fd, offset, length)  # a file system without readahead: plain reads do the same
        return runs, cached
    for pos in range(offset + length - 1, offset - 1, -_WAIT_STEP):
        os.pread(fd, 1, pos)
    if cached_bytes(fd, offset, length) < length:  # readahead(2) is a hint: it may leave a few pages out
        for start, end in _missing_runs(fd, offset, length):
            _read_through(fd, start, end - start)
    return runs, cached


def _missing_runs(fd: int, offset: int, length: int) -> list[tuple[int, int]]:
    absent = np.flatnonzero(resident_pages(fd, offset, length) == 0)
    if absent.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(absent) != 1) + 1
    end = offset + length
    return [(offset + int(r[0]) * PAGE, min(end, offset + (int(r[-1]) + 1) * PAGE)) for r in np.split(absent, breaks)]


def _read_through(fd: int, offset: int, length: int) -> None:
    buf = bytearray(min(length, 1 << 20))
    view = memoryview(buf)
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [view[: min(len(buf), end - offset)]], offset)
        if n <= 0:
            return
        offset += n


def reclaim(fd: int, offset: int, length: int) -> tuple[int, int]:
    """Drop the range's clean, unmapped pages (POSIX_FADV_DONTNEED); returns (bytes dropped, bytes still
    cached): what stays is mapped by some process (or dirty), and may be dropped once it is unmapped."""
    before = cached_bytes(fd, offset, length)
    if before == 0:
        return 0, 0
    evict(fd, offset, length)
    after = cached_bytes(fd, offset, length)
    return max(0, before - after), after


def page_span(offset: int, length: int) -> tuple[int, int]:
    """[start, end) of the pages covering a byte range."""
    return offset - offset % PAGE, -(-(offset + length) // PAGE) * PAGE
