"""The prefetch engine on a real file with scripted loader events: budget, cursor, abandon, burn-after-reading."""

from __future__ import annotations

import os
import threading
import time

import pytest

from prefetch_support import drop, make_checkpoint
from weightstream.prefetch.events import ACCESS, MISS, PageEvent
from weightstream.prefetch.plan import Plan
from weightstream.prefetch.prefetcher import Prefetcher
from weightstream.prefetch.settings import Settings
from weightstream.prefetch.residency import cached_bytes
from weightstream.prefetch.template import LoadTemplate, WorkerTemplate

MIB = 1 << 20


@pytest.fixture()
def one_file(tmp_path):
    root = make_checkpoint(tmp_path / "m", {"w.safetensors": 32 * MIB})
    path = str(root / "w.safetensors")
    drop([path])
    st = os.stat(path)
    return path, (st.st_dev, st.st_ino)


def _prefetcher(path, ident, **settings) -> Prefetcher:
    template = LoadTemplate({}, "k", [], [WorkerTemplate("p", [(0, 0, 32 * MIB)])], "tracefs", 0.0)
    return Prefetcher(Plan.from_template(template), [path], [ident], Settings(threads=2, **settings))


def _settle(p: Prefetcher, want: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while p.counters.prefetched + p.counters.already_cached < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # and nothing more arrives: the budget holds the threads


def _cached(path: str, offset: int, length: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_bytes(fd, offset, length)
    finally:
        os.close(fd)


def _event(kind, ident, offset, length=4096):
    return PageEvent(kind, 1, 1, ident[0], ident[1], offset, length)


def test_budget_cursor_abandon_and_reclaim(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=6 * MIB, reclaim_gap=2 * MIB)
    p.go()
    try:
        _settle(p, 6 * MIB)
        assert p.counters.prefetched == 6 * MIB and _cached(path, 0, 32 * MIB) == 6 * MIB
        p.on_events([_event(ACCESS, ident, 4 * MIB + 100)])  # loader in chunk 2: three chunks are free again
        _settle(p, 12 * MIB)
        assert p.counters.prefetched == 12 * MIB and p.counters.peak_ahead <= 6 * MIB
        p.on_events([_event(MISS, ident, 28 * MIB, MIB)])  # its own readahead far ahead: not consumption
        time.sleep(0.2)
        assert p.counters.prefetched == 12 * MIB and p.counters.abandoned == 0
        p.on_events([_event(ACCESS, ident, 20 * MIB)])  # loader jumps to chunk 10: 6..9 are abandoned
        _settle(p, 18 * MIB)
        assert p.counters.abandoned == 10 * MIB  # chunks 6, 7, 8, 9 and 10 itself, which the loader read
        assert p.counters.reclaimed == 12 * MIB  # chunks 0..5 were cached; 0..8 are 2 MiB+ behind
        assert _cached(path, 0, 18 * MIB) <= 64 << 10  # (our 4 KiB event page may be read by nobody)
        p.on_events([_event(MISS, ident, 2 * MIB, 8192)])
        assert p.counters.reread_after_reclaim == 8192
    finally:
        p.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("ws-")]


def test_unlimited_prefetch_reads_everything_and_counts_used(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident)
    p.go()
    _settle(p, 32 * MIB)
    p.on_events([_event(ACCESS, ident, 0, 8 * MIB)])
    p.stop()
    assert p.counters.prefetched == 32 * MIB and p.counters.reclaimed == 0
    assert p.used_bytes() == 8 * MIB
    assert _cached(path, 0, 32 * MIB) == 32 * MIB


def test_residency_mode_ignores_its_own_reads(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=4 * MIB)
    p.own_misses_visible = True
    p.go()
    _settle(p, 4 * MIB)
    p.on_events([_event(MISS, ident, 0, 4 * MIB)])  # what a sampler sees of our own prefetch
    time.sleep(0.2)
    assert p.counters.prefetched == 4 * MIB and p.counters.loader_missed == 0
    p.on_events([_event(MISS, ident, 10 * MIB)])  # a page we never issued: the loader's
    _settle(p, 8 * MIB)
    p.stop()
    assert p.counters.loader_missed == 4096 and p.counters.prefetched == 8 * MIB


def test_a_miss_far_behind_the_cursor_rewinds(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=4 * MIB, reclaim_gap=2 * MIB)
    p.go()
    try:
        _settle(p, 4 * MIB)
        p.on_events([_event(ACCESS, ident, 30 * MIB)])  # a first pass ran to the end (chunk 15) ...
        time.sleep(0.2)
        assert p.counters.reclaimed == 4 * MIB and p.counters.rewinds == 0
        p.on_events([_event(MISS, ident, 0)])  # ... and a second pass starts over, from disk
        _settle(p, 8 * MIB)
        assert p.counters.rewinds == 1 and p.counters.reread_after_reclaim == 4096
        assert p.counters.prefetched == 8 * MIB  # chunks 1 and 2 again, within the budget
        assert _cached(path, 2 * MIB, 4 * MIB) == 4 * MIB
        p.on_events([_event(ACCESS, ident, 20 * MIB)])
        time.sleep(0.2)
        assert p.counters.reclaimed == 4 * MIB  # a loader that reads twice is not burnt after reading
    finally:
        p.stop()


def test_eviction_before_use_halves_the_budget(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=16 * MIB)
    p.go()
    try:
        _settle(p, 16 * MIB)
        drop([path])  # what reclaim in a full memory cgroup does to pages nobody has read yet
        p.on_events([_event(ACCESS, ident, 2 * MIB), _event(MISS, ident, 2 * MIB, 2 * MIB)])
        assert p.counters.evicted_before_use > 0 and p.budget == 8 * MIB
        p.on_events([_event(MISS, ident, 4 * MIB, 2 * MIB)])  # within 100 ms: counted, not halved again
        assert p.budget == 8 * MIB
    finally:
        p.stop()
