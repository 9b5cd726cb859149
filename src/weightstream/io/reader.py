"""O_DIRECT reads into aligned memory by a pool of dedicated I/O threads; demand requests before read-ahead."""

from __future__ import annotations

import errno
import itertools
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from weightstream.errors import WeightstreamError
from weightstream.io.aligned import ALIGN, AlignedArena, aligned_span

DEMAND, READ_AHEAD = 0, 1
DEFAULT_CHUNK_BYTES = 1024 * 1024  # from the pipeline sweep in docs/benchmarks.md


@dataclass(slots=True)
class ReadRequest:
    """Read file bytes [offset, offset+nbytes) so that they land at arena offset `dest` + (offset % 4096)."""

    path: str
    offset: int
    nbytes: int
    dest: int  # 4 KiB-aligned offset in the arena


@dataclass(slots=True)
class ReadBatch:
    """Several requests completed together: `on_done(error)` runs once, on the I/O thread of the last chunk."""

    on_done: Callable[[BaseException | None], None]
    remaining: int
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # chunks not yet started are skipped; `on_done` still runs once all are through


class DirectReader:
    """A pool of I/O threads reading chunks with O_DIRECT (buffered where the filesystem refuses it)."""

    def __init__(
        self,
        arena: AlignedArena,
        threads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        o_direct: bool = True,
        warn=None,
    ):
        if threads < 1:
            raise WeightstreamError(f"--io-threads {threads}: need at least 1 I/O thread")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise WeightstreamError(f"chunk size {chunk_bytes}: must be a positive multiple of {ALIGN} bytes")
        self.arena, self.chunk_bytes, self.want_o_direct, self.threads = arena, chunk_bytes, o_direct, threads
        self._warn = warn or (lambda msg: print(f"weightstream: {msg}", file=sys.stderr))
        self._fds: dict[str, tuple[int, bool]] = {}
        self._probe = AlignedArena(ALIGN)
        self._fd_lock = threading.Lock()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._stats_lock = threading.Lock()
        self.bytes_read = 0
        self.buffered_fallback = False
        self._threads = [threading.Thread(target=self._work, name=f"ws-io-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, requests: list[ReadRequest], on_done, priority: int = DEMAND) -> ReadBatch:
        """Queue the chunks of `requests` in order; `on_done(error_or_None)` runs when all have landed."""
        chunks = [c for r in requests for c in self._chunks(r)]
        batch = ReadBatch(on_done, len(chunks))
        if not chunks:
            on_done(None)
        for chunk in chunks:
            self._queue.put((priority, next(self._seq), chunk, batch))
        return batch

    def open_files(self, paths) -> None:
        """Open (and probe) these files now, so that the first read of each during decode does not pay for it."""
        for path in paths:
            self._fd(path)

    def cancel(self, batch: ReadBatch) -> None:
        """Skip the batch's chunks that no thread has started (a read-ahead nobody needs any more)."""
        batch.cancelled = True

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((99, next(self._seq), None, None))
        for t in self._threads:
            t.join()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _chunks(self, r: ReadRequest):
        """(path, file position, arena offset, bytes to read, bytes that must arrive) per chunk of `r`."""
        start, end = aligned_span(r.offset, r.nbytes)
        for pos in range(start, end, self.chunk_bytes):
            n = min(self.chunk_bytes, end - pos)
            yield (r.path, pos, r.dest + (pos - start), n, min(pos + n, r.offset + r.nbytes) - pos)

    def _work(self) -> None:
        while True:
            _, _, chunk, batch = self._queue.get()
            if chunk is None:
                return
            error = None
            try:
                if not batch.cancelled:
                    self._read_chunk(*chunk)
            except BaseException as exc:  # reported to the waiting layer, never lost on this thread
                error = exc
            with batch.lock:
                batch.error = batch.error or error
                batch.remaining -= 1
                last = batch.remaining == 0
            if last:
                batch.on_done(batch.error)

    def _read_chunk(self, path: str, pos: int, dest: int, n: int, need: int) -> None:
        """Read `n` bytes at `pos`; only the aligned tail past the request's end may be cut short (end of file)."""
        fd, _ = self._fd(path)
        view = self.arena.view[dest : dest + n]
        got = os.preadv(fd, [view], pos)
        with self._stats_lock:
            self.bytes_read += got
        if got < need:  # else the slot would keep whatever bytes it held before: wrong output, no error
            raise WeightstreamError(
                f"{path}: short read at byte {pos}: got {got} bytes, the checkpoint's index "
                f"needs {need} (file now {os.fstat(fd).st_size} bytes); the file was truncated "
                "or replaced after loading, reload the model"
            )

    def _fd(self, path: str) -> tuple[int, bool]:
        with self._fd_lock:
            if path not in self._fds:
                self._fds[path] = self._open(path)
            return self._fds[path]

    def _open(self, path: str) -> tuple[int, bool]:
        if self.want_o_direct and hasattr(os, "O_DIRECT"):
            fd = None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                got = os.preadv(fd, [self._probe.view], 0)  # some filesystems accept the flag, then refuse reads
                with self._stats_lock:
                    self.bytes_read += got  # a real device read: counted like any other
                return fd, True
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise WeightstreamError(f"{path}: cannot open for reading ({exc.strerror})") from exc
                self._note_fallback(path, exc)
        try:
            return os.open(path, os.O_RDONLY), False
        except OSError as exc:
            raise WeightstreamError(f"{path}: cannot open for reading ({exc.strerror})") from exc

    def _note_fallback(self, path: str, exc: OSError) -> None:
        if not self.buffered_fallback:
            self.buffered_fallback = True
            self._warn(
                f"O_DIRECT refused for {path} ({exc.strerror}); falling back to buffered reads "
                "(the page cache will hold copies of expert bytes)"
            )
