"""Read-ahead slot bookkeeping on the real cache and reader: a read-ahead still in flight is awaited, never evicted
under a demand read, and never displaces the running layer. One read is held at a gate to keep it in flight."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from weightstream.cache.policies import make_policy
from weightstream.cache.policy import insert_read_ahead
from weightstream.engine.loader import load_streaming_model
from weightstream.io.aligned import aligned_span

GATES = []  # released at teardown, so a failing test does not leave an I/O thread held


class Gate:
    """Holds the I/O thread that reads the first chunk of `key`'s expert until `release()`; the read is real."""

    def __init__(self, cache, key):
        self.reached, self._open = threading.Event(), threading.Event()
        GATES.append(self)
        first_path, offset, nbytes, _ = cache.plans[key].requests[0]
        start, real, reader = aligned_span(offset, nbytes)[0], cache.reader._read_chunk, cache.reader

        def read(path, pos, *rest):
            if (path, pos) == (first_path, start) and not self._open.is_set():
                self.reached.set()
                self._open.wait(60)
            real(path, pos, *rest)

        reader._read_chunk = read

    def release(self):
        self._open.set()


@pytest.fixture
def olmoe(request, tiny_model):
    """(expert cache of 1x = 6 slots over 3 layers x 8 experts, 2 I/O threads unless the test asks; eager reference)."""
    model_dir = tiny_model("olmoe")
    threads = getattr(request, "param", 2)
    model = load_streaming_model(model_dir, expert_cache="1x", io_threads=threads)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    yield model.weightstream.cache, ref
    while GATES:
        GATES.pop().release()
    model.weightstream.close()


def fill(cache, steps):
    for layer, experts in steps:
        fetch = cache.fetch_layer(layer, experts)
        for _ in fetch.missing:
            cache.wait(fetch)


def assert_bytes_are(cache, ref, keys):
    path_of = {layer: path for path, layer in cache.layout.module_layers.items()}
    for layer, expert in keys:
        module = ref.get_submodule(path_of[layer])
        for name, tensor in cache.params(layer, expert).items():
            assert torch.equal(tensor, getattr(module, name)[expert]), (layer, expert, name)


def test_demand_lookup_of_a_read_ahead_in_flight_waits_for_its_bytes(olmoe):
    cache, ref = olmoe
    gate = Gate(cache, (1, 3))
    assert cache.read_ahead(1, [3], running=set()) == 1
    assert gate.reached.wait(30)
    fetch = cache.fetch_layer(1, [3, 5])
    assert fetch.resident == [] and sorted(fetch.missing) == [3, 5]
    assert cache.wait(fetch) == 5  # the demand read passes the held read-ahead
    assert fetch.arrived.empty()  # expert 3 is not announced while its bytes are still coming
    gate.release()
    assert cache.wait(fetch) == 3
    cache.close()
    assert fetch.arrived.empty()  # announced exactly once
    assert_bytes_are(cache, ref, [(1, 3), (1, 5)])
    s = cache.stats
    assert (s.hits, s.misses, s.readahead_issued, s.readahead_used, s.readahead_wasted) == (1, 1, 1, 1, 0)


def test_evicting_a_read_ahead_in_flight_waits_so_the_demand_read_is_not_overwritten(olmoe):
    cache, ref = olmoe
    gate = Gate(cache, (1, 0))
    assert cache.read_ahead(1, [0], running=set()) == 1
    assert gate.reached.wait(30)
    fill(cache, [(0, [0, 1]), (2, [0, 1]), (1, [1])])  # full; the unused read-ahead (1, 0) is least recent
    assert len(cache.slot_of) == cache.n_slots == 6
    result = []
    lookup = threading.Thread(target=lambda: result.append(cache.fetch_layer(2, [5])))
    lookup.start()
    lookup.join(0.5)
    assert lookup.is_alive()  # blocked: its victim's slot is still being written
    gate.release()
    lookup.join(30)
    assert cache.wait(result[0]) == 5
    cache.close()  # every read has landed: a late read-ahead would have overwritten expert 5's slot by now
    assert (1, 0) not in cache.slot_of
    assert_bytes_are(cache, ref, [(2, 5)])
    assert cache.stats.readahead_wasted == 1 and cache.stats.readahead_used == 0
    assert cache.stats.readahead_cancelled == 1 and cache.stats.eviction_wait_s > 0  # cancelled, but already reading


def test_read_ahead_never_evicts_the_running_layer_and_stops_when_all_is_pinned(olmoe):
    cache, ref = olmoe
    fill(cache, [(0, [0, 1]), (2, [0, 1]), (1, [1, 2])])  # full; the running layer 0's experts are least recent
    assert cache.read_ahead(1, [1, 2], running=set()) == 0  # resident already: nothing is read twice
    running = {(0, 0), (0, 1)}
    assert cache.read_ahead(1, [3, 4, 5, 6, 7], running=running) == 4  # only 4 unpinned slots to give
    assert set(cache.slot_of) == running | {(1, e) for e in (3, 4, 5, 6)}
    cache.close()
    assert_bytes_are(cache, ref, sorted(cache.slot_of))
    assert cache.stats.readahead_issued == 4 and cache.stats.misses == 6


@pytest.mark.parametrize("olmoe", [1], indirect=True)  # one I/O thread: a held read keeps every later one queued
def test_a_wrong_guess_still_queued_is_cancelled_and_never_read(olmoe):
    cache, ref = olmoe
    fill(cache, [(0, [0, 1]), (2, [0, 1]), (1, [1, 2])])
    gate = Gate(cache, (1, 3))
    assert cache.read_ahead(1, [3, 4], running=set()) == 2  # (1, 3) is held; (1, 4) waits behind it, coldest
    assert gate.reached.wait(30)
    before = cache.reader.bytes_read
    result = []
    lookup = threading.Thread(target=lambda: result.append(cache.fetch_layer(2, [5])))
    lookup.start()
    gate.release()
    lookup.join(30)
    assert cache.wait(result[0]) == 5
    cache.close()
    read = cache.reader.bytes_read - before
    held, demanded = (cache.plans[k].aligned_bytes for k in ((1, 3), (2, 5)))
    assert read == held + demanded  # (1, 4)'s chunks were skipped
    assert cache.stats.readahead_cancelled == 1 and (1, 4) not in cache.slot_of and (1, 3) in cache.slot_of
    assert_bytes_are(cache, ref, sorted(cache.slot_of))  # every resident expert, (1, 3) and (2, 5) among them


@pytest.mark.parametrize(
    "name, opts", [("lru", {}), ("slru", {}), ("lfu", {}), ("adaptive", {}), ("pinned", {"pinned_keys": [(9, 9)]})]
)
def test_a_guess_is_the_next_victim_until_a_lookup_finds_it(name, opts):
    old, guess = [(0, 0), (0, 1)], (1, 5)
    for looked_up in (False, True):
        policy = make_policy(name, 3, working_set_slots=2, **opts)
        for key in old:
            policy.on_insert(key)
        insert_read_ahead(policy, guess)
        if looked_up:
            policy.on_hit(guess)
        assert policy.evict(set()) == (old[0] if looked_up else guess), (name, looked_up)
