"""Page-aligned memory for O_DIRECT reads, and the arithmetic of aligned spans."""

from __future__ import annotations

import mmap
import os

import torch

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def round_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def region_bytes(nbytes: int) -> int:
    """Room for one tensor read with O_DIRECT: its start may sit anywhere inside the first 4 KiB page."""
    return round_up(nbytes) + ALIGN


def aligned_span(offset: int, nbytes: int) -> tuple[int, int]:
    """The 4 KiB-aligned file range [start, end) that covers [offset, offset + nbytes)."""
    return round_down(offset), round_up(offset + nbytes)


def aligned_bytes(piece, file_size: int | None = None) -> int:
    """Bytes an O_DIRECT read of `piece` (path, offset, nbytes) fetches: its aligned span, cut at end of file."""
    start, end = aligned_span(piece.offset, piece.nbytes)
    return min(end, os.path.getsize(piece.path) if file_size is None else file_size) - start


class AlignedArena:
    """One anonymous mapping (page-aligned, untouched pages cost no memory) viewed as bytes and as a tensor."""

    def __init__(self, nbytes: int):
        assert nbytes > 0 and nbytes % ALIGN == 0, nbytes
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        assert self.address % ALIGN == 0

    def release(self) -> None:
        """Gives every page back to the kernel now (they read as zeros after), whoever still holds a view."""
        self._map.madvise(mmap.MADV_DONTNEED)
