"""The page cache model `tune` predicts the mmap path with: the kernel's readahead and two lists over byte ranges."""

import numpy as np
import pytest

from weightstream.cache.slot_plan import file_runs, merge_spans
from weightstream.sim.page_cache_model import PageCacheModel, Readahead, inactive_ratio, replay
from weightstream.store.layout import Piece
from weightstream.units import GIB, MIB


def test_adjacent_pieces_merge_into_one_span_and_far_ones_do_not():
    pieces = [(0, 8 * MIB, 4 * MIB), (0, 0, 4 * MIB), (0, 4 * MIB + 64, 4 * MIB), (1, 0, MIB), (0, 40 * MIB, MIB)]
    assert merge_spans(pieces, gap=4096) == [(0, 0, 12 * MIB), (0, 40 * MIB, 41 * MIB), (1, 0, MIB)]
    assert merge_spans(pieces, gap=0)[0] == (0, 0, 4 * MIB)


def test_the_reader_merges_a_checkpoints_pieces_as_the_page_cache_model_does():
    """One merge for both: the slot plan's stretches of `Piece`s are the page-cache model's spans at gap 0."""
    pieces = [Piece("b", 0, 100), Piece("a", 300, 50), Piece("a", 0, 300), Piece("a", 400, 10), Piece("a", 0, 300)]
    runs = file_runs(pieces, 0, lambda p: (p.path, p.offset, p.nbytes))
    assert [(f, a, b) for f, a, b, _ in runs] == [("a", 0, 350), ("a", 400, 410), ("b", 0, 100)]
    assert [len(members) for *_, members in runs] == [2, 1, 1]  # the piece given twice counts once
    ids = {"a": 0, "b": 1}
    as_spans = merge_spans((ids[p.path], p.offset, p.nbytes) for p in pieces)
    assert as_spans == [(ids[f], a, b) for f, a, b, _ in runs]


def test_readahead_splits_the_calibrated_extra_bytes_around_the_span():
    one = [(0, 0, 12 * MIB)]  # an expert in one span
    (ra,) = Readahead.per_span(1.75, one, 8 * MIB)  # 9 MiB extra: the window's half ahead
    assert (ra.before, ra.after) == (4 * MIB, 5 * MIB)
    assert Readahead.per_span(1.0, one, 8 * MIB) == (Readahead(0, 0),)
    assert Readahead.per_span(1.5, one, None) == (Readahead(3 * MIB, 3 * MIB),)


def test_an_expert_in_several_tensors_shares_its_extra_bytes_among_its_spans_by_length():
    """gpt-oss's layout: down (16 MiB) and gate_up (32 MiB) far apart, a tiny bias beside each. The expert's
    calibrated 24 MiB extra goes 8 / 16 to the two large spans, each with the window's half ahead; giving every
    span the whole expert's extra read 1.8x the kernel's bytes (docs/benchmarks.md as of commit 8df4075)."""
    spans = [(0, 0, 16 * MIB), (0, 100 * MIB, 100 * MIB + 8192), (0, 200 * MIB, 232 * MIB)]
    total = 48 * MIB + 8192
    shares = Readahead.per_span(1 + 24 * MIB / total, spans, 8 * MIB)
    assert [r.before + r.after for r in shares] == pytest.approx([8 * MIB, 4096, 16 * MIB], rel=1e-3)
    assert shares[0].before == shares[2].before == 4 * MIB  # half the read-around window ahead of each fault
    assert shares[1].before + shares[1].after < 8192
    assert Readahead.per_span(1.0, spans, 8 * MIB) == (Readahead(0, 0),) * 3


def test_per_span_readahead_reads_each_span_with_its_share():
    spans = [[(0, 0, 4 * MIB), (1, 0, 8 * MIB)]]
    ra = [(Readahead(0, MIB), Readahead(0, 2 * MIB))]
    assert PageCacheModel(spans, GIB, ra, MIB).access(0) == (False, 15 * MIB)
    with pytest.raises(ValueError, match="one Readahead per span"):
        PageCacheModel(spans, GIB, [(Readahead(0, MIB),)], MIB)


def test_inactive_ratio_follows_the_kernel():
    assert inactive_ratio(512 * MIB) == 1
    assert inactive_ratio(1 * GIB) == 3
    assert inactive_ratio(10 * GIB) == 10


def _experts(n: int, size: int, gap: int) -> list[list[tuple[int, int, int]]]:
    """n experts of `size` bytes in one file, `gap` bytes apart."""
    return [[(0, i * (size + gap), i * (size + gap) + size)] for i in range(n)]


def test_a_cold_fault_reads_the_span_and_its_readahead_then_hits():
    m = PageCacheModel(_experts(4, 4 * MIB, 16 * MIB), GIB, Readahead(MIB, 2 * MIB), MIB)
    assert m.access(1) == (False, 7 * MIB)
    assert m.access(1) == (True, 0)
    assert m.bytes_read == 7 * MIB and m.evicted == 0


def test_readahead_brings_in_the_neighbour_that_is_used_next():
    m = PageCacheModel(_experts(4, 4 * MIB, 0), GIB, Readahead(0, 4 * MIB), MIB)
    assert m.access(0) == (False, 8 * MIB)
    assert m.access(1) == (True, 0)  # expert 1 lies where the readahead read


def test_a_file_end_bounds_the_readahead():
    m = PageCacheModel(_experts(2, 4 * MIB, 0), GIB, Readahead(MIB, 16 * MIB), MIB, file_bytes=[8 * MIB])
    assert m.access(1) == (False, 5 * MIB)  # 1 MiB ahead, nothing past the file's 8 MiB


def test_untouched_readahead_is_reclaimed_before_touched_experts():
    """A cache of 4 experts' bytes, each fault bringing 4 MiB of readahead nobody touches: LRU over what was read
    would lose expert 0 by the third fault; the kernel reclaims the untouched readahead first."""
    m = PageCacheModel(_experts(8, 4 * MIB, 32 * MIB), 16 * MIB, Readahead(0, 4 * MIB), MIB)
    for key in (0, 0, 1, 1, 2, 2):  # touched twice: active
        m.access(key)
    assert m.access(0)[0] and m.access(1)[0]
    assert len(m.inactive) + len(m.active) <= m.capacity


def test_the_cache_never_holds_more_than_its_capacity_and_counts_what_it_reclaims():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 64, size=2000)
    m = PageCacheModel(_experts(64, 2 * MIB, MIB), 40 * MIB, Readahead(MIB, MIB), MIB)
    hit, read, evicted = replay(m, keys)
    assert len(m.inactive) + len(m.active) <= m.capacity
    assert read.sum() == m.bytes_read
    # everything read either is still cached or was reclaimed
    assert read.sum() == evicted.sum() + (len(m.inactive) + len(m.active)) * MIB
    assert 0 < hit.mean() < 1


@pytest.mark.parametrize("capacity", [8 * MIB, 64 * MIB, 512 * MIB])
def test_more_room_never_reads_more_on_a_looping_workload(capacity):
    keys = np.tile(np.arange(16), 20)
    small = PageCacheModel(_experts(16, 2 * MIB, 0), capacity, Readahead(0, MIB), MIB)
    big = PageCacheModel(_experts(16, 2 * MIB, 0), 2 * capacity, Readahead(0, MIB), MIB)
    assert replay(big, keys)[1].sum() <= replay(small, keys)[1].sum()


def test_a_touch_moves_nothing_and_the_active_list_ages_first_in_first_out():
    """Mapped pages: a hit only sets the young bit, and reclaim deactivates the active list's oldest chunks whatever
    their bits. Expert 1, hit just before expert 5 faults, goes; expert 2, not touched since it came in, stays
    (an LRU over touches would keep 1 and lose 2)."""
    m = PageCacheModel(_experts(8, 4 * MIB, 0), 16 * MIB, Readahead(0, 0), MIB)
    for key in range(5):  # the fifth fault activates every young chunk, then reclaims expert 0
        m.access(key)
    assert not any((0, c) in m.inactive or (0, c) in m.active for c in range(4))
    assert m.access(1) == (True, 0)
    assert m.access(5) == (False, 4 * MIB)
    assert m.access(2) == (True, 0)
    assert m.access(1) == (False, 4 * MIB)


def test_a_refault_inside_the_workingset_enters_the_active_list_and_an_old_one_does_not():
    m = PageCacheModel(_experts(16, 4 * MIB, 0), 16 * MIB, Readahead(0, 0), MIB)
    for key in range(5):
        m.access(key)
    assert m.access(0) == (False, 4 * MIB)  # evicted 4 chunks ago, the active list 16 long: activated
    assert all((0, c) in m.active for c in range(4))
    for key in range(5, 16):  # 44 more evictions
        m.access(key)
    assert m.access(1) == (False, 4 * MIB)
    assert all((0, c) in m.inactive for c in range(4, 8))
