"""Page-cache events as weightstream sees them, and the parser for tracefs text lines.

A miss is a page the kernel added to the page cache for the file; an access is an mmap fault or fault-around
mapping; a read is one step of a read() call. Misses are recorded; accesses and reads move the replay cursor.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

MISS, ACCESS, READ = "miss", "access", "read"

# tracefs text with options/record-tgid: "<comm>-<tid> (<tgid>) [cpu] flags ts: event: payload".
_LINE = re.compile(
    rb"-(\d+) +(?:\( *([\d-]+)\) +)?\[\d+\] \S+ +[\d.]+: mm_filemap_(\w+): dev[ =](\d+):(\d+) ino[ =]([0-9a-f]+) "
    rb"(?:pfn=\S+ )?ofs=(\d+)(?:-(\d+))?(?: order=(\d+))?"
)
# get_pages fires for every batch of a read() with the range still requested (start .. end of the read), so
# it is its own kind: ReadSpans turns those into what was actually read.
_KINDS = {b"add_to_page_cache": MISS, b"map_pages": ACCESS, b"get_pages": READ, b"fault": ACCESS}
EVENT_KINDS = {f"mm_filemap_{k.decode()}": kind for k, kind in _KINDS.items()}  # tracefs event name -> kind
TRACE_EVENTS = tuple(EVENT_KINDS)


class PageEvent(NamedTuple):
    """`length` bytes at `offset` of file (dev, ino) became cached (MISS) or were read from cache (ACCESS)."""

    kind: str
    tid: int
    tgid: int
    dev: int  # userspace encoding, comparable with os.stat().st_dev
    ino: int
    offset: int
    length: int


def parse_trace_text(data: bytes) -> list[PageEvent]:
    """Parse complete tracefs lines; lines of other formats are skipped; continuing events joined (join_runs)."""
    return [_event(key, start, end) for key, start, end in join_runs(_line_items(data))]


def _line_items(data: bytes):
    for m in _LINE.finditer(data):
        tid, tgid, kind, major, minor, ino, ofs, end_ofs, order = m.groups()
        offset = int(ofs)
        length = int(end_ofs) + 1 - offset if end_ofs else (4096 << int(order) if order else 4096)
        yield (kind, tid, tgid, major, minor, ino), offset, length


def join_runs(items):
    """(key, offset, length) in order -> (key, start, end), consecutive items of one key that continue each other
    joined into one. Readahead adds pages one by one, in order, so for one task on one file that is most of them,
    and it keeps Python's per-event cost low."""
    key, start, end = None, 0, 0
    for this, offset, length in items:
        if this == key and offset == end:
            end += length
            continue
        if key is not None:
            yield key, start, end
        key, start, end = this, offset, offset + length
    if key is not None:
        yield key, start, end


def _event(key: tuple, start: int, end: int) -> PageEvent:
    kind, tid, tgid, major, minor, ino = key
    tgid_n = int(tgid) if tgid and tgid[:1] != b"-" else int(tid)
    return PageEvent(
        _KINDS[kind], int(tid), tgid_n, os.makedev(int(major), int(minor)), int(ino, 16), start, end - start
    )


def kernel_dev(st_dev: int) -> int:
    """The kernel's internal dev_t (major << 20 | minor), as tracefs filters compare s_dev."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


class ReadSpans:
    """Turns read() steps into the byte ranges actually read.

    One read() of N bytes logs get_pages once per batch of pages, each time with the range from the current
    position to the end of the request. Consecutive events of a task with the same end are one read: each
    step's new start says how far the previous one got. A read's last step is assumed to finish.
    """

    def __init__(self) -> None:
        self._open: dict[tuple[int, int, int], list[int]] = {}  # (tid, dev, ino) -> [start, end]

    def feed(self, e: PageEvent) -> list[tuple[int, int]]:
        """The [start, end) ranges now known to have been read."""
        key, end = (e.tid, e.dev, e.ino), e.offset + e.length
        span = self._open.get(key)
        if span is not None and span[1] == end and e.offset >= span[0]:
            done, span[0] = (span[0], e.offset), e.offset
            return [done] if done[1] > done[0] else []
        self._open[key] = [e.offset, end]
        return [(span[0], span[1])] if span is not None else []

    def flush(self) -> list[tuple[int, tuple[int, int], int, int]]:
        """Every open read as (tid, (dev, ino), start, end), assumed finished."""
        out = [(tid, (dev, ino), s, e) for (tid, dev, ino), (s, e) in self._open.items()]
        self._open.clear()
        return out
