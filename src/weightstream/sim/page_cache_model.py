"""The kernel's page cache under mmap'd experts, simulated over the checkpoint's real byte ranges.

It follows what the kernel does with mapped file pages, at the granularity of `chunk` bytes of each file, so it
sees both what readahead costs (room, until the kernel evicts the readahead pages nobody touched) and what it
brings (a neighbouring expert about to be used); docs/tune.md section 4 has its measurements against the kernel:

- A touched chunk that is not cached faults: the expert's contiguous span is read with the readahead around it
  (`before` bytes ahead of the span, `after` bytes past it: the read-around window centred on the first fault and
  the asynchronous readahead that follows a sequential walk). What a miss adds is counted as bytes read.
- Two lists, as the kernel's file LRU for mapped pages (classic LRU, no MGLRU), with what a page table tells
  reclaim: a touch only sets the chunk's young bit (the hardware's accessed bit), it moves nothing. New chunks
  enter the inactive list (the faulting span's young, its readahead not). Reclaim takes the inactive list's oldest
  chunk: young, it is activated (`folio_check_references`: a large folio with more than one young PTE is activated
  at its first scan, and on ext4 since 6.16 readahead fills large folios); else it is evicted, leaving a shadow
  entry.
- The active list is FIFO: reclaim deactivates its oldest chunk whatever its young bit (`shrink_active_list` keeps
  only executable mappings), into the inactive list with its young bit cleared, so a touch before its next scan
  activates it again. It deactivates when the inactive list is below 1 / `inactive_ratio` of the cache
  (`inactive_is_low`, ratio sqrt(10 x GiB)) or when refaults were activated since the last reclaim
  (`may_deactivate`), and then scans both lists by the same share of their length (`shrink_lruvec`'s targets,
  size >> priority), at most `ratio` active chunks per inactive one.
- A refault whose shadow is younger than the active list (evictions and refault activations since its eviction, at
  most the active list's length: `workingset_refault`) enters the active list directly.

A chunk touched twice while inactive is not activated, and the active list is not kept in LRU order: that is how
the kernel treats pages read with read(2), not mapped ones. The dense weights share the lists (`sim.tune`), and
the readahead is the one measured around a lone expert's fault (`bench.calibrate`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightstream.units import GIB, MIB

Span = tuple[int, int, int]  # (file id, first byte, end byte): `cache.slot_plan.merge_spans` makes them


def inactive_ratio(capacity_bytes: int) -> int:
    """The kernel's active:inactive target for file pages: int(sqrt(10 x GiB)), 1 below 1 GiB."""
    gib = capacity_bytes / GIB
    return max(int(math.sqrt(10 * gib)), 1) if gib >= 1 else 1


@dataclass(frozen=True, slots=True)
class Readahead:
    """Bytes the kernel reads around a faulting span: `before` its start and `after` its end."""

    before: int
    after: int

    @classmethod
    def per_span(cls, amplification: float, spans: Sequence[Span], window_bytes: int | None) -> tuple[Readahead, ...]:
        """One expert's calibrated extra bytes (amplification - 1 of its bytes) shared among its spans by length,
        each share split by `_split`. The kernel reads around every faulting span, but an expert whose bytes lie in
        several tensors (gate_up, down and their biases on gpt-oss) was calibrated as a whole, so its extra bytes
        are shared, not given whole to each span (docs/tune.md)."""
        lengths = [b - a for _, a, b in spans]
        total = sum(lengths) or 1
        extra = max(amplification - 1.0, 0.0) * total
        return tuple(cls._split(extra * n / total, window_bytes) for n in lengths)

    @classmethod
    def _split(cls, extra: float, window_bytes: int | None) -> Readahead:
        """`extra` bytes around a span: half the read-around window ahead (it is centred on the fault), the rest
        past the span's end."""
        before = min(window_bytes / 2, extra) if window_bytes else extra / 2
        return cls(int(before), int(extra - before))


class PageCacheModel:
    """Replays expert accesses against a simulated page cache of `capacity_bytes`; counts faults and bytes read."""

    def __init__(
        self,
        spans: Sequence[Sequence[Span]],
        capacity_bytes: int,
        readahead: Readahead | Sequence[Sequence[Readahead]],
        chunk_bytes: int = MIB,
        file_bytes: Sequence[int] | None = None,
    ):
        """`readahead`: one for every span, or one per span of every expert (`Readahead.per_span`)."""
        self.spans, self.chunk = spans, int(chunk_bytes)
        self.ra = [[readahead] * len(s) for s in spans] if isinstance(readahead, Readahead) else readahead
        if len(self.ra) != len(spans) or any(len(r) != len(s) for r, s in zip(self.ra, spans)):
            raise ValueError("readahead: one Readahead per span of every expert")
        self.capacity = max(int(capacity_bytes // self.chunk), 1)
        self.ratio = inactive_ratio(capacity_bytes)
        self.file_chunks = [math.ceil(b / self.chunk) for b in file_bytes] if file_bytes else None
        self.inactive: OrderedDict[tuple[int, int], bool] = OrderedDict()  # chunk -> young (touched since its scan)
        self.active: OrderedDict[tuple[int, int], None] = OrderedDict()  # oldest first, both lists
        self.shadows: dict[tuple[int, int], int] = {}  # evicted chunk -> the eviction clock when it went
        self.clock = 0  # evictions and refault activations so far (the kernel's nonresident age)
        self.refault_activated = False  # since the last reclaim
        self.bytes_read = 0
        self.evicted = 0  # chunks reclaimed to make room

    def _chunks(self, f: int, a: int, b: int) -> range:
        last = math.ceil(b / self.chunk)
        if self.file_chunks is not None:
            last = min(last, self.file_chunks[f])
        return range(max(a // self.chunk, 0), last)

    def access(self, key: int) -> tuple[bool, int]:
        """Touch every byte of expert `key`: (no fault at all, bytes read)."""
        read = 0
        for (f, a, b), ra in zip(self.spans[key], self.ra[key]):
            fresh: set[int] = set()  # chunks the fault just brought in, young already
            for c in self._chunks(f, a, b):
                chunk = (f, c)
                if c in fresh or chunk in self.active:
                    continue  # an active chunk's young bit changes nothing: the active list ages in FIFO order
                if chunk in self.inactive:
                    self.inactive[chunk] = True
                elif not fresh:  # the first fault in this span reads the span and its readahead
                    fresh = self._fault(f, a, b, ra)
                    read += len(fresh) * self.chunk
            if fresh:
                self._reclaim()
        self.bytes_read += read
        return read == 0, read

    def _fault(self, f: int, a: int, b: int, ra: Readahead) -> set[int]:
        new = set()
        span = self._chunks(f, a, b)
        for c in self._chunks(f, a - ra.before, b + ra.after):
            chunk = (f, c)
            if chunk in self.active or chunk in self.inactive:
                continue
            evicted_at = self.shadows.pop(chunk, None)
            if evicted_at is not None and self.clock - evicted_at <= len(self.active):
                self.active[chunk] = None  # a refault inside the workingset: straight to the active list
                self.clock += 1
                self.refault_activated = True
            else:
                self.inactive[chunk] = c in span  # the span's own chunks are touched; readahead's are not
            new.add(c)
        return new

    def _reclaim(self) -> None:
        deactivate = self.refault_activated or len(self.inactive) * self.ratio < len(self.active)
        self.refault_activated = False
        credit = 0.0
        while len(self.inactive) + len(self.active) > self.capacity:
            if self.active and (deactivate or not self.inactive):
                # both lists by the same share of their length, at most `ratio` active chunks per inactive one
                credit += min(len(self.active) / max(len(self.inactive), 1), self.ratio)
                while credit >= 1 and self.active:
                    chunk, _ = self.active.popitem(last=False)
                    self.inactive[chunk] = False  # its young bit cleared by the scan that deactivated it
                    credit -= 1
            chunk, young = self.inactive.popitem(last=False)
            if young:
                self.active[chunk] = None
            else:
                self.shadows[chunk] = self.clock
                self.clock += 1
                self.evicted += 1


def replay(model: PageCacheModel, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hit, bytes read, bytes reclaimed to make room) per access of `keys`, in order."""
    hit = np.zeros(len(keys), dtype=bool)
    read = np.zeros(len(keys), dtype=np.int64)
    evicted = np.zeros(len(keys), dtype=np.int64)
    for i, key in enumerate(keys.tolist()):
        before = model.evicted
        hit[i], read[i] = model.access(key)
        evicted[i] = (model.evicted - before) * model.chunk
    return hit, read, evicted
