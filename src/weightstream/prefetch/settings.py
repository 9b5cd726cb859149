"""Prefetch settings (what the user chose) and counters (what happened), shared by the engine and the report."""

from __future__ import annotations

from dataclasses import dataclass, field

from weightstream.cgroup import CgroupMemory
from weightstream.prefetch.numa import Placement


@dataclass(slots=True)
class Settings:
    """How prefetch behaves: budget (None: unlimited), reclaim gap, thread count, placement, pressure floor."""

    budget: int | None = None
    reclaim_gap: int | None = 1 << 30  # None: never burn after reading
    threads: int = 4
    placement: Placement = field(default_factory=lambda: Placement(None, (), ""))
    pressure_floor: int = 256 << 20
    cgroup: CgroupMemory | None = None


@dataclass(slots=True)
class Counters:
    """What happened, in bytes (and a few counts); the report derives its figures from these."""

    prefetched: int = 0
    already_cached: int = 0
    abandoned: int = 0
    reclaimed: int = 0
    reread_after_reclaim: int = 0
    loader_missed: int = 0
    failed_chunks: int = 0
    pressure_pauses: int = 0
    events: int = 0
    rewinds: int = 0
    evicted_before_use: int = 0  # prefetched, then evicted by the kernel before the loader read it
    peak_ahead: int = 0  # most bytes ever prefetched (or in flight) and not yet reached by the loader
    timeline: list = field(default_factory=list)  # (seconds, worker, loader position, prefetch position, ahead)
