"""The replay plan: each worker's template ranges cut into chunks, and a lookup from a file position to them."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from weightstream.prefetch.template import LoadTemplate

CHUNK = 2 << 20  # one prefetch I/O; small enough that abandoning or stopping is prompt
MULTI_PASS = 1.25  # reads per distinct byte above which a recorded worker counts as making several passes


@dataclass(slots=True)
class Chunk:
    """A piece of one worker's template: file number, byte offset and length, and its place in the order."""

    file: int
    offset: int
    length: int
    worker: int
    index: int
    position: int  # bytes of this worker's template before this chunk
    shared: bool = False  # never reclaimed: also in another worker's template, or in a file its worker holds mapped


@dataclass(slots=True)
class Plan:
    """Per worker, the ordered chunks; per file, the chunks sorted by offset for lookups."""

    workers: list[list[Chunk]]
    _starts: dict[int, list[int]]
    _chunks: dict[int, list[Chunk]]
    chunk: int = CHUNK
    no_burn: list[bool] = field(default_factory=list)  # per worker: never burn after reading (see from_template)

    @classmethod
    def from_template(cls, template: LoadTemplate, chunk: int = CHUNK) -> Plan:
        """Cut every range into chunks of at most `chunk` bytes."""
        workers = []
        for w, worker in enumerate(template.workers):
            chunks, position = [], 0
            for f, offset, length in worker.ranges:
                for o in range(offset, offset + length, chunk):
                    n = min(chunk, offset + length - o)
                    chunks.append(Chunk(f, o, n, w, len(chunks), position))
                    position += n
            workers.append(chunks)
        by_file: dict[int, list[Chunk]] = {}
        for c in (c for chunks in workers for c in chunks):
            by_file.setdefault(c.file, []).append(c)
        for chunks in by_file.values():
            chunks.sort(key=lambda c: (c.offset, c.worker, c.index))
            _mark_shared(chunks)
        # No burning after reading for a worker that reads its bytes twice; nor of the files a worker keeps
        # mapped to its end (its tensors are those pages), or of any file when which ones it held is unknown.
        for chunks, worker in zip(workers, template.workers):
            held = set(worker.held_files or ())
            for c in chunks:
                c.shared = c.shared or c.file in held
        multi = [w.reads_per_byte > MULTI_PASS or (w.holds_mapped and w.held_files is None) for w in template.workers]
        return cls(workers, {f: [c.offset for c in cs] for f, cs in by_file.items()}, by_file, chunk, multi)

    def lookup(self, file: int, start: int, end: int) -> list[Chunk]:
        """Chunks of any worker that overlap [start, end) of file."""
        chunks = self._chunks.get(file)
        if not chunks:
            return []
        i = max(0, bisect.bisect_right(self._starts[file], start) - 1)
        # Back up over earlier chunks that may still reach start (overlapping ranges, several workers).
        while i > 0 and chunks[i - 1].offset + self.chunk > start:
            i -= 1
        out = []
        while i < len(chunks) and chunks[i].offset < end:
            if chunks[i].offset + chunks[i].length > start:
                out.append(chunks[i])
            i += 1
        return out

    @property
    def bytes(self) -> int:
        """Bytes over all chunks."""
        return sum(c.length for chunks in self.workers for c in chunks)


def _mark_shared(chunks: list[Chunk]) -> None:
    reach_end, reach_worker = -1, -1
    owner: Chunk | None = None
    for c in chunks:
        if c.offset < reach_end and c.worker != reach_worker:
            c.shared = True
            if owner is not None:
                owner.shared = True
        if c.offset + c.length > reach_end:
            reach_end, reach_worker, owner = c.offset + c.length, c.worker, c
