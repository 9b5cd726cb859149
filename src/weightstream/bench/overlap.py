"""The overlap check: is each expert-cache run as fast as max(compute alone, its reads alone) allows?

Compute alone is the same engine and prompts with every expert already resident; reads alone are the run's
decode bytes at the reader's own O_DIRECT bandwidth on this checkpoint, measured cold.
"""

from __future__ import annotations

import threading
import time

from weightstream.bench.coldstart import drop_page_cache
from weightstream.io.aligned import AlignedArena, region_bytes, round_up
from weightstream.io.reader import DirectReader, ReadRequest
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.layout import Piece
from weightstream.units import GIB, MIB

OVERLAP_TARGET = 1.25


def judge_overlap(runs: list[dict], compute_s: float, bandwidth: dict) -> list[dict]:
    """Each expert-cache run's time per token against max(compute-only time per token, its reads / bandwidth)."""
    out = []
    for r in runs:
        if r.get("mode") != "expert-cache" or "error" in r:
            continue
        io_s = r["decode_bytes_read_per_token"] / MIB / bandwidth["mib_per_s"]
        per_token = 1 / r["decode_tokens_per_s"]
        bound = max(compute_s, io_s)
        out.append(
            {
                "expert_cache": r["expert_cache"],
                "time_per_token_s": per_token,
                "compute_only_s": compute_s,
                "read_s": io_s,
                "bound_s": bound,
                "ratio": per_token / bound,
                "within_target": per_token / bound <= OVERLAP_TARGET,
            }
        )
    return out


def reader_bandwidth(model_dir: str, io_threads: int, chunk_bytes: int | None, limit_bytes: int = 2 * GIB) -> dict:
    """The reader's own O_DIRECT bandwidth on this checkpoint's expert pieces, page cache dropped first.

    Pieces go in batches of 64 into two halves of a buffer, the next batch queued while the last is read, so
    the I/O threads never run dry (as during a layer's misses), but no more is queued than decode ever queues.
    """
    pieces = [
        Piece(t.path, t.offset, t.nbytes) for t in open_checkpoint(model_dir).tensors.values() if ".experts." in t.name
    ]
    pieces = sorted(pieces, key=lambda p: (p.path, p.offset))
    group = 64
    half = round_up(max(region_bytes(p.nbytes) for p in pieces) * group)
    arena = AlignedArena(2 * half)
    reader = DirectReader(arena, threads=io_threads, **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
    drop_page_cache(sorted({p.path for p in pieces}))
    free = [threading.Event(), threading.Event()]
    for event in free:
        event.set()
    total, start = 0, time.perf_counter()
    for i in range(0, len(pieces), group):
        if total >= limit_bytes:
            break
        which = (i // group) % 2
        free[which].wait()  # the batch that last used this half has landed
        free[which].clear()
        requests, dest = [], which * half
        for p in pieces[i : i + group]:
            requests.append(ReadRequest(p.path, p.offset, p.nbytes, dest))
            dest += region_bytes(p.nbytes)
        reader.submit(requests, lambda err, e=free[which]: e.set())
        total += sum(p.nbytes for p in pieces[i : i + group])
    for event in free:
        event.wait()
    elapsed = time.perf_counter() - start
    read = reader.bytes_read
    reader.close()
    return {
        "bytes": read,
        "seconds": elapsed,
        "mib_per_s": read / MIB / elapsed,
        "io_threads": io_threads,
        "chunk_bytes": reader.chunk_bytes,
    }
