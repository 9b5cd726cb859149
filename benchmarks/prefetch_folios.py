"""How a file's pages got into the page cache changes what a loader pays to map them: one file, dropped from the
cache, filled one way, then touched through a mapping page by page (as an mmap loader does), counting faults.

    PYTHONPATH=src .venv/bin/python benchmarks/prefetch_folios.py FILE [none|readahead|pread|populate ...]

none: the touch itself faults the pages in (the kernel's fault-path readahead: large folios). readahead:
readahead(2) on weightstream's prefetch descriptor, in 2 MiB chunks (what `prefetch run` does). pread: reads
into a buffer. populate: a mapping of each 2 MiB chunk with MADV_POPULATE_READ. Prints one JSON line per way.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import resource
import sys
import time

from weightstream.io.pagecache import evict_file
from weightstream.prefetch import fetch as io

CHUNK = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def fill(path: str, how: str, size: int) -> None:
    if how == "readahead":
        fd = io.open_for_prefetch(path)
        for off in range(0, size, CHUNK):
            _libc.readahead(fd, ctypes.c_longlong(off), ctypes.c_size_t(CHUNK))
        for off in range(0, size, 128 << 10):  # wait for the reads, as fetch() does
            os.pread(fd, 1, off)
    elif how == "pread":
        fd, buf = os.open(path, os.O_RDONLY), bytearray(CHUNK)
        for off in range(0, size, CHUNK):
            os.preadv(fd, [buf], off)
    elif how == "populate":
        fd = os.open(path, os.O_RDONLY)
        for off in range(0, size, CHUNK):
            m = mmap.mmap(fd, min(CHUNK, size - off), prot=mmap.PROT_READ, offset=off)
            m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
            m.close()
    elif how != "none":
        raise SystemExit(f"unknown way {how!r}: none, readahead, pread or populate")


def main() -> None:
    path, ways = sys.argv[1], sys.argv[2:] or ["none", "readahead", "pread", "populate"]
    size = os.path.getsize(path)
    for how in ways:
        evict_file(path)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fill(path, how, size)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        for off in range(0, size, 4096):
            m[off]
        m.close()
        r2, t2 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        print(
            json.dumps(
                {
                    "way": how,
                    "bytes": size,
                    "fill_s": round(t1 - t0, 3),
                    "fill_cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 3),
                    "touch_s": round(t2 - t1, 3),
                    "touch_minor_faults": r2.ru_minflt - r1.ru_minflt,
                    "touch_major_faults": r2.ru_majflt - r1.ru_majflt,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
