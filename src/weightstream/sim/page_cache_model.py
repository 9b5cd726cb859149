"""The kernel's page cache under mmap'd experts, simulated over the checkpoint's real byte ranges.

`tune` used to model the page cache as LRU over whole experts whose capacity shrank by the measured readahead
(bytes cached per expert byte touched, 1.7 on this VM's 8 MiB `read_ahead_kb`). That model missed both ways in the
proof (docs/benchmarks.md, issue 14): it charged readahead for the room it takes although the kernel evicts
readahead pages that nobody touched first, and it could not see readahead that brings in an expert about to be
used (experts stored next to each other: a replayed Mixtral routing uses experts 0-7 of every layer). This model
follows what the kernel does, at the granularity of `chunk` bytes of each file:

- A touched chunk that is not cached faults: the expert's contiguous span is read with the readahead around it
  (`before` bytes ahead of the span, `after` bytes past it: the read-around window centred on the first fault and
  the asynchronous readahead that follows a sequential walk). What a miss adds is counted as bytes read.
- Two lists, as the kernel's file LRU: new chunks enter the inactive list, the faulting ones marked referenced;
  a chunk touched again while inactive is activated; reclaim takes the inactive list's oldest chunk, giving a
  referenced one a second lap (as `folio_check_references` keeps a mapped page referenced once), and refills the
  inactive list from the active one when it falls below 1 / `inactive_ratio` of the cache (the kernel's
  `inactive_is_low`, ratio sqrt(10 x GiB)).

The kernel's shadow entries (refault distance activating a refaulted page) are not modelled.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from weightstream.units import GIB, MIB

Span = tuple[int, int, int]  # (file id, first byte, end byte)


def merge_spans(pieces: Iterable[tuple[int, int, int]], gap: int = 0) -> list[Span]:
    """Pieces (file id, offset, nbytes) merged into contiguous spans (pieces at most `gap` bytes apart join)."""
    spans: list[list[int]] = []
    for file_id, offset, nbytes in sorted(pieces):
        if spans and spans[-1][0] == file_id and offset <= spans[-1][2] + gap:
            spans[-1][2] = max(spans[-1][2], offset + nbytes)
        else:
            spans.append([file_id, offset, offset + nbytes])
    return [(f, a, b) for f, a, b in spans]


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
        several tensors (gate_up, down and their biases on gpt-oss) was calibrated as a whole: giving each span the
        whole expert's extra read 1.8x the kernel's bytes there (docs/benchmarks.md)."""
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
        self.inactive: OrderedDict[tuple[int, int], bool] = OrderedDict()  # chunk -> referenced; oldest first
        self.active: OrderedDict[tuple[int, int], None] = OrderedDict()
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
            fresh: set[int] = set()  # chunks the fault just brought in, marked touched there
            for c in self._chunks(f, a, b):
                chunk = (f, c)
                if c in fresh:
                    continue
                if chunk in self.active:
                    self.active.move_to_end(chunk)
                elif chunk in self.inactive:
                    if self.inactive[chunk]:  # touched twice while inactive: activated
                        del self.inactive[chunk]
                        self.active[chunk] = None
                    else:
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
            self.inactive[chunk] = c in span  # the span's own chunks are touched; readahead's are not
            new.add(c)
        return new

    def _reclaim(self) -> None:
        while len(self.inactive) + len(self.active) > self.capacity:
            while self.active and len(self.inactive) * self.ratio < len(self.active):
                chunk, _ = self.active.popitem(last=False)  # aged out of the active list
                self.inactive[chunk] = False
            if not self.inactive:
                self.active.popitem(last=False)
                self.evicted += 1
                continue
            chunk, referenced = self.inactive.popitem(last=False)
            if referenced:  # touched once: a second lap, unreferenced (the kernel keeps it, clearing the bit)
                self.inactive[chunk] = False
            else:
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
