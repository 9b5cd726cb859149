"""The prefetch engine on a real file with scripted loader events: budget, reads, abandon, rewind, reclaim."""

from __future__ import annotations

import os
import threading
import time

import pytest

from weightstream.io.pagecache import cached_bytes
from weightstream.prefetch.events import ACCESS, MISS, PageEvent
from weightstream.prefetch.plan import Plan
from weightstream.prefetch.prefetcher import Prefetcher
from weightstream.prefetch.settings import Settings
from weightstream.prefetch.template import LoadTemplate, WorkerTemplate

from prefetch_support import drop, make_checkpoint

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("no_proactive_reclaim")  # they count pages in the page cache


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


def _cached(path: str, offset: int, length: int, want: int | None = None, timeout: float = 5.0) -> int:
    """Bytes of the range in the page cache; with `want`, waits up to `timeout` for that many (pages that
    readahead(2) queued are counted once their read completes, which may be a moment after fetch returns)."""
    deadline = time.monotonic() + timeout
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            got = cached_bytes(fd, offset, length)
            if want is None or got >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.01)
    finally:
        os.close(fd)


def _event(kind, ident, offset, length=4096, tid=1):
    return PageEvent(kind, tid, 1, ident[0], ident[1], offset, length)


def _reads(ident, *chunks):
    return [_event(ACCESS, ident, c * 2 * MIB + 100) for c in chunks]


def test_budget_holds_until_the_loader_reads(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=6 * MIB)
    p.go()
    try:
        _settle(p, 6 * MIB)
        assert p.counters.prefetched == 6 * MIB and _cached(path, 0, 32 * MIB, want=6 * MIB) == 6 * MIB
        p.on_events([_event(MISS, ident, 28 * MIB, MIB)])  # its own readahead far ahead: not a read
        p.on_events(_reads(ident, 2))  # one of our three chunks read: one more may come
        _settle(p, 8 * MIB)
        assert p.counters.prefetched == 8 * MIB and p.counters.abandoned == 0
        p.on_events(_reads(ident, 0, 1))
        _settle(p, 12 * MIB)
        assert p.counters.prefetched == 12 * MIB and p.counters.peak_ahead <= 6 * MIB
    finally:
        p.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("ws-")]


def test_a_stray_read_far_ahead_abandons_one_chunk_not_the_template(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=4 * MIB)
    p.go()
    try:
        _settle(p, 4 * MIB)
        p.on_events(_reads(ident, 15))  # e.g. a header at the end of a file, read early
        assert p.counters.abandoned == 2 * MIB
        p.on_events(_reads(ident, 0, 1, 2, 3, 4, 5, 6, 7))  # the loader outruns us: 2..7 are its own
        _settle(p, 8 * MIB)
        assert p.counters.abandoned == 2 * MIB + 7 * 2 * MIB  # 2..8: nine chunks read put it at chunk 8
        assert (
            p.counters.prefetched == 8 * MIB and _cached(path, 18 * MIB, 4 * MIB, want=4 * MIB) == 4 * MIB
        )  # chunks 9, 10
    finally:
        p.stop()


def test_burn_after_reading_then_a_second_pass_rewinds(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=32 * MIB, reclaim_gap=4 * MIB)
    p.go()
    try:
        _settle(p, 32 * MIB)
        p.on_events(_reads(ident, *range(8)))  # read up to 16 MiB: what ends before 12 MiB is burnt
        assert p.counters.reclaimed == 12 * MIB and _cached(path, 0, 12 * MIB) == 0
        assert _cached(path, 12 * MIB, 20 * MIB, want=20 * MIB) == 20 * MIB
        p.on_events([_event(MISS, ident, 2 * MIB, 8192)])  # the same thread misses far behind: a new pass
        _settle(p, 42 * MIB)
        assert p.counters.rewinds == 1 and p.counters.reread_after_reclaim == 8192
        assert p.counters.prefetched == 42 * MIB  # chunks 1..5 again (0 was read before the pass began)
        p.on_events(_reads(ident, *range(1, 16)))
        time.sleep(0.2)
        assert p.counters.reclaimed == 12 * MIB  # a loader that reads twice is not burnt after reading
    finally:
        p.stop()


def test_pages_mapped_when_burnt_are_burnt_once_the_loader_unmaps_them(one_file):
    """safetensors maps a shard and touches all of it: burning behind the cursor finds the pages mapped, and
    DONTNEED leaves them. Once the mapping is gone (the loader moved on), the next events burn them."""
    import mmap

    path, ident = one_file
    p = _prefetcher(path, ident, budget=32 * MIB, reclaim_gap=4 * MIB)
    p.go()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        _settle(p, 32 * MIB)
        for offset in range(0, 32 * MIB, 4096):  # the loader's view of its tensors: every page mapped
            m[offset]
        p.on_events(_reads(ident, *range(8)))
        assert p.counters.reclaimed == 0 and _cached(path, 0, 12 * MIB, want=12 * MIB) == 12 * MIB  # mapped: kept
        m.close()
        p.on_events(_reads(ident, 8))  # the same file, within the retry interval: not yet tried again
        assert p.counters.reclaimed == 2 * MIB  # only chunk 6, newly due and no longer mapped
        time.sleep(1.1)
        p.on_events(_reads(ident, 9))
        assert p.counters.reclaimed == 16 * MIB and _cached(path, 0, 16 * MIB) == 0  # 0..5 retried, 7 due
    finally:
        if not m.closed:
            m.close()
        p.stop()


def test_eviction_before_use_halves_the_budget(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=16 * MIB)
    p.go()
    try:
        _settle(p, 16 * MIB)
        drop([path])  # what reclaim in a full memory cgroup does to pages nobody has read yet
        p.on_events([_event(MISS, ident, 0, 2 * MIB)])  # just after we read them: a race, not pressure
        assert p.counters.evicted_before_use == 2 * MIB and p.budget == 16 * MIB
        time.sleep(0.6)
        p.on_events([_event(ACCESS, ident, 2 * MIB), _event(MISS, ident, 2 * MIB, 2 * MIB)])
        assert p.counters.evicted_before_use > 2 * MIB and p.budget == 8 * MIB
        p.on_events([_event(MISS, ident, 4 * MIB, 2 * MIB)])  # within 100 ms: counted, not halved again
        assert p.budget == 8 * MIB
    finally:
        p.stop()


def test_unlimited_prefetch_reads_everything_and_counts_used(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident)
    p.go()
    _settle(p, 32 * MIB)
    p.on_events([_event(ACCESS, ident, 0, 8 * MIB)])
    p.stop()
    assert p.counters.prefetched == 32 * MIB and p.counters.reclaimed == 0
    assert p.used_bytes() == 8 * MIB
    assert _cached(path, 0, 32 * MIB, want=32 * MIB) == 32 * MIB


def test_residency_mode_ignores_its_own_reads_and_sweeps(one_file):
    path, ident = one_file
    p = _prefetcher(path, ident, budget=4 * MIB)
    p.own_misses_visible = True
    p.go()
    _settle(p, 4 * MIB)
    p.on_events([_event(MISS, ident, 0, 4 * MIB)])  # what a sampler sees of our own prefetch
    time.sleep(0.2)
    assert p.counters.prefetched == 4 * MIB and p.counters.loader_missed == 0
    p.on_events([_event(MISS, ident, 10 * MIB)])  # a page we never issued: the loader's, and it is past 0..4
    _settle(p, 8 * MIB)
    p.stop()
    assert p.counters.loader_missed == 4096 and p.counters.prefetched == 8 * MIB
    assert p.counters.abandoned == 4 * 2 * MIB  # chunks 2..5, which it read itself
