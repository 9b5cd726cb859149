"""Measurement pieces for the prefetch benchmark: cold cache, device bandwidth, one timed command run."""

from __future__ import annotations

import json
import mmap
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from weightstream.bench.coldstart import drop_system_page_cache
from weightstream.cgroup import MemoryCgroup
from weightstream.io.pagecache import cached_bytes, evict_file

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def weight_files(model: Path) -> list[str]:
    return sorted(str(p) for p in model.glob("*.safetensors"))


def make_cold(model: Path) -> int:
    """Drop the model's pages (per file; the global drop_caches when permitted); returns bytes left cached."""
    return sum(evict_file(p) for p in weight_files(model))


def global_drop_note() -> str:
    """Whether /proc/sys/vm/drop_caches works here (tried once, for the record)."""
    return drop_system_page_cache() or "dropped the whole page cache (/proc/sys/vm/drop_caches)"


def direct_read_bandwidth(paths: list[str], limit: int, threads: int = 4, block: int = MIB) -> float:
    """Bytes/s of O_DIRECT reads of up to `limit` bytes, `threads` in parallel: what the device gives."""
    todo = [(p, o) for p in paths for o in range(0, os.path.getsize(p) // block * block, block)]
    todo = todo[: limit // block]
    total = len(todo) * block
    lock, fds = threading.Lock(), {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}

    def worker() -> None:
        buf = mmap.mmap(-1, block)
        while True:
            with lock:
                if not todo:
                    return
                path, offset = todo.pop()
            os.preadv(fds[path], [buf], offset)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total / seconds


def buffered_read_bandwidth(paths: list[str], limit: int) -> float:
    """Bytes/s of one sequential buffered reader (kernel readahead), cold: what a naive loader gets at best."""
    t0, done = time.perf_counter(), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while done < limit and (chunk := f.read(4 * MIB)):
                done += len(chunk)
    return done / (time.perf_counter() - t0)


@dataclass
class Outcome:
    """One timed run of a command."""

    wall_s: float
    returncode: int
    cpu_s: float  # user+sys of the whole process tree (wrapper and loader)
    loader: dict = field(default_factory=dict)
    report: dict | None = None
    cgroup_peak: int | None = None
    stderr_tail: str = ""


def timed(argv: list[str], env: dict, report: Path | None = None, cgroup: MemoryCgroup | None = None) -> Outcome:
    """Run argv (optionally inside a memory cgroup), timing it from spawn to exit."""
    if report is not None and report.exists():
        report.unlink()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cgroup.enter_argv(argv) if cgroup else argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    out = Outcome(
        wall,
        done.returncode,
        cpu,
        json.loads(lines[-1]) if lines else {},
        stderr_tail="\n".join(done.stderr.splitlines()[-6:]),
    )
    if report is not None and report.exists():
        out.report = json.loads(report.read_text())
    if cgroup is not None:
        out.cgroup_peak = cgroup.peak_bytes
    return out


def loader_argv(loader: str, model: Path) -> list[str]:
    return [sys.executable, str(HERE / "prefetch_loaders.py"), loader, str(model)]


def still_cached(model: Path) -> int:
    total = 0
    for p in weight_files(model):
        fd = os.open(p, os.O_RDONLY)
        total += cached_bytes(fd)
        os.close(fd)
    return total


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
