"""The page cache, seen and steered per file: cachestat(2) counts, mincore(2) bitmaps, and eviction.

None of this needs root. Evicting (POSIX_FADV_DONTNEED) drops a file's clean, unmapped pages only; pages
mapped by a process or still dirty stay. Dropping the whole system's page cache for a cold start is
measurement work and lives in `weightstream.bench.coldstart`.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from weightstream.units import PAGE

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


def mapped_resident_bytes(address: int, length: int) -> int:
    """Bytes of this process's memory [address, address+length) mapped in its page tables now (anonymous or
    file-backed, the pages the range touches in whole), by /proc/self/pagemap's present bit: what the process
    holds, where mincore(2) would count a file's pages that are in the page cache for anyone."""
    if length <= 0:
        return 0
    first, last = address // PAGE, (address + length - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * PAGE


def evict(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop the range's clean, unmapped pages from the page cache (length 0: to the end of the file)."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def evict_file(path: str) -> int:
    """Drop a file's pages from the page cache; returns the bytes still cached (mapped or dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # DONTNEED skips dirty pages: a freshly written checkpoint must reach the disk first
        evict(fd)
        return cached_bytes(fd)
    finally:
        os.close(fd)


def process_read_bytes() -> int | None:
    """Bytes this process (all its threads) has had fetched from storage: `read_bytes` of /proc/self/io, which
    the block layer counts per submitted read, so mmap faults and the readahead around them count, page-cache hits
    do not. None where the kernel does not keep it (no task I/O accounting)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
