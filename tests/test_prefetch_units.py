"""Pure pieces of prefetch, each against an independent reference: specs, sizes, intervals, merging, plans."""

from __future__ import annotations

import random

import pytest

from weightstream.errors import WeightstreamError
from weightstream.prefetch.events import parse_trace_text
from weightstream.prefetch.merge import RangeMerger
from weightstream.prefetch.pages import ISSUED, TOUCHED, PageCounter, PageFlags
from weightstream.prefetch.plan import Plan
from weightstream.prefetch.spec import DeploymentSpec
from weightstream.prefetch.template import LoadTemplate, WorkerTemplate, pack_ranges, unpack_ranges
from weightstream.units import PAGE, parse_size

MIB = 1 << 20


def test_spec_key_ignores_order_and_rejects_bad_pairs():
    a = DeploymentSpec.parse(["model=qwen", "tp=2"])
    assert a.key == DeploymentSpec.parse(["tp=2", "model=qwen"]).key
    assert a.key != DeploymentSpec.parse(["model=qwen", "tp=1"]).key
    for bad in (["model"], ["=x"], ["a=1", "a=2"], []):
        with pytest.raises(WeightstreamError):
            DeploymentSpec.parse(bad)


def test_parse_size_units_and_errors():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("1073741824") == 1 << 30
    with pytest.raises(WeightstreamError, match="--memory-budget"):
        parse_size("lots", "--memory-budget")


def test_page_flags_and_counter_match_a_set_of_pages():
    rng = random.Random(1)
    flags, ref = PageFlags(300 * PAGE - 5), {ISSUED: set(), TOUCHED: set()}
    counter, seen, total = PageCounter(), set(), 0
    for _ in range(200):
        flag = rng.choice([ISSUED, TOUCHED])
        s = rng.randrange(0, 290 * PAGE)
        e = s + rng.randrange(1, 9 * PAGE)
        flags.set(flag, s, e)
        ref[flag].update(range(s // PAGE, -(-e // PAGE)))
        counter.add(s, e - s)
        seen.update(range(s // PAGE, -(-e // PAGE)))
        total += e - s
    probe = set(range(40, 140))
    assert flags.count(40 * PAGE, 140 * PAGE, ISSUED) == len(ref[ISSUED] & probe) * PAGE
    assert flags.total(ISSUED | TOUCHED) == len(ref[ISSUED] & ref[TOUCHED]) * PAGE
    assert flags.total(ISSUED, TOUCHED) == len(ref[ISSUED] - ref[TOUCHED]) * PAGE
    assert counter.total == total and counter.distinct == len(seen) * PAGE


def test_merger_joins_interleaved_streams_and_keeps_time_order():
    m = RangeMerger(segment=64 * MIB, gap=MIB)
    # Two threads of one process read two regions of file 0 in 4 KiB pages, interleaved.
    for i in range(256):
        m.add(7, "loader", 0, i * 4096, 4096)
        m.add(7, "loader", 0, 100 * MIB + i * 4096, 4096)
    m.add(9, "other", 1, 0, 8192)
    pids, w = zip(*m.workers())
    assert pids == (7, 9) and [x.name for x in w] == ["loader", "other"]
    assert w[0].ranges == [(0, 0, MIB), (0, 100 * MIB, MIB)]
    assert w[1].ranges == [(1, 0, 8192)]


def test_merger_caps_segments_and_bridges_small_gaps():
    m = RangeMerger(segment=8 * MIB, gap=MIB)
    reads = [(i + (MIB // 4 if i == 4 * MIB else 0), MIB // 2) for i in range(0, 20 * MIB, MIB)]
    for offset, length in reads:  # half of every MiB: holes of 512 KiB, below the 1 MiB gap, are bridged
        m.add(1, "p", 0, offset, length)
    ranges = m.workers()[0][1].ranges
    assert len(ranges) == 3 and all(length <= 8 * MIB for _, _, length in ranges)
    assert all(a[1] + a[2] <= b[1] for a, b in zip(ranges, ranges[1:]))  # in order, no overlap
    for offset, length in reads:
        assert any(r[1] <= offset and offset + length <= r[1] + r[2] for r in ranges)


def test_pack_ranges_roundtrip_and_size():
    ranges = [(0, i * 32 * MIB, 16 * MIB) for i in range(128)] + [(1, 4096, 8192), (0, 0, 4096)]
    assert unpack_ranges(pack_ranges(ranges)) == ranges
    assert len(pack_ranges(ranges)) < 200  # regular strides compress to almost nothing


def test_plan_lookup_matches_brute_force():
    t = LoadTemplate(
        {},
        "k",
        [],
        [WorkerTemplate("a", [(0, 0, 5 * MIB), (1, 3 * MIB, 3 * MIB)]), WorkerTemplate("b", [(0, 4 * MIB, 4 * MIB)])],
        "tracefs",
        0.0,
    )
    plan = Plan.from_template(t)
    chunks = [c for w in plan.workers for c in w]
    rng = random.Random(3)
    for _ in range(300):
        f, s = rng.randrange(2), rng.randrange(0, 10 * MIB)
        e = s + rng.randrange(1, 3 * MIB)
        want = {(c.worker, c.index) for c in chunks if c.file == f and c.offset < e and c.offset + c.length > s}
        assert {(c.worker, c.index) for c in plan.lookup(f, s, e)} == want
    shared = {(c.worker, c.offset) for c in chunks if c.shared}
    assert (0, 4 * MIB) in shared and (1, 4 * MIB) in shared and (0, 0) not in shared


def test_parse_trace_text_joins_consecutive_pages():
    text = (
        b"  python-41 (   40) [001] ..... 1.0: mm_filemap_add_to_page_cache: dev 254:0 ino 1f pfn=0x1 ofs=0 "
        b"order=0\n"
        b"  python-41 (   40) [001] ..... 1.0: mm_filemap_add_to_page_cache: dev 254:0 ino 1f pfn=0x2 ofs=4096 "
        b"order=2\n"
        b"  my-prog-42 (   40) [000] ..... 1.1: mm_filemap_map_pages: dev=254:0 ino=1f ofs=65536-131071\n"
        b"  <...>-43 (-----) [000] ..... 1.2: mm_filemap_fault: dev=254:0 ino=1f ofs=8192\n"
    )
    ev = parse_trace_text(text)
    assert [(e.kind, e.tid, e.tgid, e.ino, e.offset, e.length) for e in ev] == [
        ("miss", 41, 40, 0x1F, 0, 4096 + 16384),
        ("access", 42, 40, 0x1F, 65536, 65536),
        ("access", 43, 43, 0x1F, 8192, 4096),
    ]
