"""The reader's time to land a layer's misses, measured as the engine queues them: one batch per expert, its slot
plan's requests, demand priority, the engine's I/O threads and chunk size. Batches of 1, 2, 4, ... experts give
the line t = latency + experts x seconds per expert that `tune`'s cost model uses. `ExpertReads.prime` reads
experts once ahead of a timed run that will miss them."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from weightstream.cache.slot_plan import plan_slot
from weightstream.io.aligned import AlignedArena
from weightstream.io.reader import DEMAND, DirectReader, ReadRequest
from weightstream.store.layout import ModelLayout
from weightstream.units import MIB

READ_LIMIT_BYTES = 512 * MIB  # calibration reads at most this much


def batch_sizes(top_k: int, expert_bytes: int, limit: int = READ_LIMIT_BYTES, repeats: int = 3) -> list[int]:
    """Batches of 1, 2, 4, ... up to top-k experts, repeated up to `repeats` times within `limit` bytes."""
    sizes = sorted({1, 2, *[2**i for i in range(2, 8) if 2**i < top_k], max(top_k, 2)})
    while len(sizes) > 2 and sum(sizes) * expert_bytes > limit:
        sizes.pop()
    reps = max(1, min(repeats, limit // (sum(sizes) * expert_bytes)))
    return [s for _ in range(reps) for s in sizes]


class ExpertReads:
    """Reads whole experts as the engine does (slot plans, one batch per expert, demand priority) into scratch."""

    def __init__(self, layout: ModelLayout, io_threads: int, chunk_bytes: int | None, max_batch: int):
        self.layout, self.max_batch = layout, max_batch
        self.file_sizes = {p.path: os.path.getsize(p.path) for e in layout.experts.values() for p in e.pieces}
        kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        self.reader = DirectReader(AlignedArena(max_batch * layout.slot_bytes), threads=io_threads, **kwargs)
        self.reader.open_files(sorted(self.file_sizes))

    def land(self, keys) -> tuple[float, int]:
        """(seconds until every expert of `keys` had landed, bytes read), all queued at once."""
        plans = [plan_slot(self.layout.experts[key], self.file_sizes) for key in keys]
        return _land(self.reader, plans, self.layout.slot_bytes), sum(p.aligned_bytes for p in plans)

    def prime(self, keys) -> None:
        """Read `keys` once, untimed: a disk with a cache of its own then serves them as it serves repeated misses."""
        keys = list(keys)
        for i in range(0, len(keys), self.max_batch):
            self.land(keys[i : i + self.max_batch])

    def close(self) -> None:
        self.reader.close()


def read_timing(layout: ModelLayout, io_threads: int, chunk_bytes: int | None, seed: int = 2) -> dict:
    """Seconds until each batch of experts had landed: first read, and read again at once (the line's points).

    Decode's misses are mostly experts read before and evicted since; O_DIRECT leaves no page-cache copy, but a
    disk with a cache of its own (a virtual disk's host) serves such repeats faster than first reads. On a plain
    NVMe the two are the same.
    """
    rng = np.random.default_rng(seed)
    keys = list(layout.experts)
    order = [keys[i] for i in rng.permutation(len(keys))]
    batches = batch_sizes(layout.top_k, layout.slot_bytes // 2)  # each batch is read twice
    reads = ExpertReads(layout, io_threads, chunk_bytes, max(batches))
    first, again, used, read_bytes = [], [], 0, 0
    try:
        for size in batches:
            chosen = [order[(used + i) % len(order)] for i in range(size)]
            used += size
            first.append(reads.land(chosen)[0])
            seconds, nbytes = reads.land(chosen)
            again.append(seconds)
            read_bytes += nbytes
    finally:
        reads.close()
    return {
        "batches": batches,
        "seconds": again,
        "first_read_seconds": first,
        "mib_per_expert": read_bytes / MIB / sum(batches),
        "io_threads": io_threads,
        "chunk_bytes": reads.reader.chunk_bytes,
        "o_direct": not reads.reader.buffered_fallback,
    }


def _land(reader: DirectReader, plans, slot_bytes: int) -> float:
    """Queue each expert's requests as one batch (as a layer's misses are queued) and wait for all of them."""
    left, errors, done, lock = [len(plans)], [], threading.Event(), threading.Lock()

    def landed(error: BaseException | None) -> None:
        with lock:
            if error is not None:
                errors.append(error)
            left[0] -= 1
            if left[0] == 0:
                done.set()

    start = time.perf_counter()
    for i, plan in enumerate(plans):
        base = i * slot_bytes
        reader.submit([ReadRequest(path, off, n, base + dest) for path, off, n, dest in plan.requests], landed, DEMAND)
    done.wait()
    if errors:
        raise errors[0]
    return time.perf_counter() - start
