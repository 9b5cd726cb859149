"""Turn a stream of page-cache misses into a short ordered list of ranges per process.

Loaders read several regions at once (worker threads, one tensor per thread), so misses interleave. Each
process keeps a few open segments; a miss that continues one extends it. A segment closes when it reaches
SEGMENT bytes, goes idle, or is pushed out by newer ones; the template lists segments in the order their
first miss happened, so replay follows the loader's progress in time while staying a few ranges per GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightstream.prefetch.template import WorkerTemplate
from weightstream.units import page_ceil, page_floor

SEGMENT = 64 << 20  # a range's largest size: bounds how far replay order can drift from the loader's
GAP = 1 << 20  # misses this close to a segment's end continue it (pages between were already cached)
OPEN = 16  # open segments per process
IDLE_EVENTS = 4096  # a segment not extended in this many of the process's misses closes


@dataclass(slots=True)
class _Segment:
    file: int
    start: int
    end: int
    first_seq: int
    last_seq: int


@dataclass(slots=True)
class _Process:
    name: str
    first_seq: int
    open: list[_Segment] = field(default_factory=list)
    closed: list[_Segment] = field(default_factory=list)
    misses: int = 0


class RangeMerger:
    """Feeds (process, file, offset, length) misses; produces one WorkerTemplate per process."""

    def __init__(self, segment: int = SEGMENT, gap: int = GAP) -> None:
        self.segment, self.gap = segment, gap
        self._procs: dict[int, _Process] = {}
        self._seq = 0

    def add(self, pid: int, name: str, file: int, offset: int, length: int) -> None:
        """Record one miss of `length` bytes at `offset` of file number `file` by process `pid`."""
        self._seq += 1
        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = _Process(name, self._seq)
        proc.misses += 1
        start, end = page_floor(offset), page_ceil(offset + length)
        while end - start > self.segment:  # one joined event can span many segments
            self._add(proc, file, start, start + self.segment)
            start += self.segment
        self._add(proc, file, start, end)

    def _add(self, proc: _Process, file: int, start: int, end: int) -> None:
        seg = self._continued(proc, file, start, end)
        if seg is not None and max(seg.end, end) - seg.start > self.segment:
            proc.open.remove(seg)  # full: the rest of this miss starts the next segment
            proc.closed.append(seg)
            start, seg = max(start, seg.end), None
        if seg is None:
            if start < end:
                proc.open.append(_Segment(file, start, end, self._seq, proc.misses))
            self._close_idle(proc)
            return
        seg.end, seg.last_seq = max(seg.end, end), proc.misses

    def _continued(self, proc: _Process, file: int, start: int, end: int) -> _Segment | None:
        for seg in reversed(proc.open):
            if seg.file == file and seg.start <= start <= seg.end + self.gap:
                return seg
        return None

    def _close_idle(self, proc: _Process) -> None:
        keep = [s for s in proc.open if proc.misses - s.last_seq < IDLE_EVENTS]
        proc.closed.extend(s for s in proc.open if s not in keep)
        while len(keep) > OPEN:
            proc.closed.append(keep.pop(0))
        proc.open = keep

    def workers(self) -> list[tuple[int, WorkerTemplate]]:
        """(pid, ranges in first-miss order with adjacent ranges joined) per process, by first miss."""
        out = []
        for pid, proc in sorted(self._procs.items(), key=lambda kv: kv[1].first_seq):
            segs = sorted(proc.closed + proc.open, key=lambda s: s.first_seq)
            out.append((pid, WorkerTemplate(proc.name, _join(segs, self.segment))))
        return out


def _join(segs: list[_Segment], limit: int) -> list[tuple[int, int, int]]:
    ranges: list[list[int]] = []
    for s in segs:
        last = ranges[-1] if ranges else None
        if last and last[0] == s.file and last[1] + last[2] == s.start and last[2] + s.end - s.start <= limit:
            last[2] += s.end - s.start
        else:
            ranges.append([s.file, s.start, s.end - s.start])
    return [tuple(r) for r in ranges]
