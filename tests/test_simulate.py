"""Simulator: fast paths == reference path (the runtime's access_layer + policies) == an independent naive
replay of the documented semantics, on the real traces; Belady bounds every policy; the CLI's outputs."""

import bisect
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from weightstream.cache.policy import wave_positions
from weightstream.errors import WeightstreamError
from weightstream.sim import Workload, kernels, replay
from weightstream.sim.replay import Options, run_one
from weightstream.trace import ModelShape, TraceWriter, save

from _real_traces import deepseek, mixtral

POLICIES = ("lru", "slru", "lfu", "pinned", "adaptive", "belady")


def naive_waves(experts, slots):
    """A layer group's experts in order of first appearance, `slots` to a wave, each wave every lookup of its experts
    in order (docs/cache-policies.md)."""
    firsts = list(dict.fromkeys(experts))
    return [[e for e in experts if e in firsts[i : i + slots]] for i in range(0, len(firsts), slots)]


def naive_hits(trace, name, slots, static=(), share=0.5, count_from=0):
    """Straight from docs/cache-policies.md, with lists: hits over accesses >= count_from."""
    groups = [
        (int(trace.group_layer[g]), wave)
        for g in range(len(trace.group_layer))
        for wave in naive_waves(trace.experts[trace.group_offsets[g] : trace.group_offsets[g + 1]].tolist(), slots)
    ]
    flat = [(layer, e) for layer, es in groups for e in es]
    where = {}
    for i, k in enumerate(flat):
        where.setdefault(k, []).append(i)
    lists, count, last, hits, i = ([], []), {}, {}, 0, 0  # lists: probation/LRU order, protected (oldest first)
    for layer, experts in groups:
        pin = {(layer, e) for e in experts}
        for e in experts:
            k = (layer, e)
            resident = k in lists[0] or k in lists[1]
            if resident:
                hits += i >= count_from
                count[k] += 1
                if name == "slru":
                    (lists[1] if k in lists[1] else lists[0]).remove(k)
                    lists[1].append(k)
                    if len(lists[1]) > int(slots * share):
                        lists[0].append(lists[1].pop(0))
                elif k not in static:
                    lists[0].remove(k)
                    lists[0].append(k)
            else:
                if len(lists[0]) + len(lists[1]) >= slots:
                    candidates = [c for c in lists[0] + lists[1] if c not in pin and c not in static]
                    if name == "lfu":
                        victim = min(candidates, key=lambda c: (count[c], last[c]))
                    elif name == "belady":
                        victim = max(
                            candidates,
                            key=lambda c, i=i: (
                                where[c][bisect.bisect_right(where[c], i)] if where[c][-1] > i else len(flat)
                            ),
                        )
                    else:
                        victim = candidates[0]
                    (lists[0] if victim in lists[0] else lists[1]).remove(victim)
                (lists[1] if k in static else lists[0]).append(k)
                count[k] = 1
            last[k] = i
            i += 1
    return hits


def test_three_replays_agree_on_mixtral_and_a_deepseek_slice():
    for trace in (mixtral(), deepseek(3)):
        w = Workload(trace, 0.5)
        ws = trace.shape.working_set_slots
        for slots in sorted({w.min_slots, ws // 2, ws, int(ws * 1.8), 2 * ws}):
            for name in POLICIES:
                size = slots * trace.shape.expert_bytes[0]
                fast, ref = run_one(w, name, size, method="fast"), run_one(w, name, size, method="reference")
                assert (fast.hits, fast.misses_per_layer) == (ref.hits, ref.misses_per_layer), (name, slots)
                inner = name if name != "adaptive" else ("lru" if slots < 1.8 * ws else "slru")
                static = set(w.pinned_keys(slots - w.min_slots)) if name == "pinned" else ()
                assert naive_hits(trace, inner, slots, static, count_from=w.count_from) == ref.hits, (name, slots)


def test_fast_equals_reference_on_thirty_deepseek_prompts():
    w = Workload(deepseek(30), 0.5)
    ws_bytes = w.trace.shape.working_set_bytes
    for mult in (0.5, 1.0, 1.4, 2.0, 4.0):
        for name in POLICIES:
            fast, ref = (run_one(w, name, int(ws_bytes * mult), method=m) for m in ("fast", "reference"))
            assert (fast.hits, fast.bytes_read) == (ref.hits, ref.bytes_read), (name, mult)


@pytest.mark.parametrize("trace_fn", [mixtral, deepseek])
def test_belady_reads_least_at_every_size(trace_fn):
    w = Workload(trace_fn(), 0.0)
    ws = w.trace.shape.working_set_bytes
    for mult in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0):
        best = run_one(w, "belady", int(ws * mult)).hits
        for name in POLICIES[:-1]:
            assert run_one(w, name, int(ws * mult)).hits <= best, (name, mult)


def test_lru_never_loses_hits_with_more_slots():
    w = Workload(deepseek(), 0.0)
    hits = [int((w.lru_distances < c).sum()) for c in range(w.min_slots, 2000, 7)]
    assert hits == sorted(hits) and hits[-1] > hits[0]


def batched(trace):
    """The same routing with each request as one batched prefill step (token choices concatenated per layer)."""
    writer = TraceWriter(trace.shape)
    for r in range(len(trace.requests)):
        steps = np.flatnonzero(trace.step_request == r)
        writer.begin_step(trace.requests[r], "prefill", len(steps))
        for layer in trace.shape.layers:
            experts = [
                e
                for s in steps
                for g in range(trace.step_groups[s], trace.step_groups[s + 1])
                if trace.group_layer[g] == layer
                for e in trace.experts[trace.group_offsets[g] : trace.group_offsets[g + 1]]
            ]
            writer.add(layer, experts)
    return writer.finish()


def test_batched_prefill_replays_identically_on_both_paths():
    t = batched(deepseek(12))
    w = Workload(t, 0.0)
    assert t.n_steps == 12 and t.n_tokens == deepseek(12).n_tokens and w.min_slots == 64
    for slots in (5, 40, 64, 200, 600):  # below 64 a layer of a step is served in waves, as the runtime does
        for name in POLICIES:
            fast, ref = (run_one(w, name, slots * t.shape.expert_bytes[0], method=m) for m in ("fast", "reference"))
            assert fast.hits == ref.hits and fast.misses_per_layer == ref.misses_per_layer, (name, slots)
            if slots < 64 and name != "adaptive":
                static = set(w.pinned_keys(slots - min(slots, 64))) if name == "pinned" else ()
                assert naive_hits(t, name, slots, static) == ref.hits, (name, slots)
    # a step reads each of a layer's experts at most once, in waves too (a later wave never reads one again)
    distinct = sum(len(set(t.experts[a:b].tolist())) for a, b in zip(t.group_offsets[:-1], t.group_offsets[1:]))
    for slots in (5, 13, 40):
        assert sum(run_one(w, "lru", slots * t.shape.expert_bytes[0]).misses_per_layer) <= distinct, slots
    # a later token reusing an expert its step already loaded is a hit even with the smallest cache
    assert run_one(w, "lru", 64 * t.shape.expert_bytes[0]).hits >= t.n_accesses - 12 * 26 * 64


def test_the_simulators_waves_are_the_runtimes():
    """kernels.wave_order (the simulator's, over every group at once) cuts each group as cache.policy.wave_positions
    (the runtime's) does: the same accesses in the same order, the same calls; empty groups make none."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        sizes = rng.integers(0, 30, size=rng.integers(1, 8))
        keys = rng.integers(0, 12, size=int(sizes.sum())).astype(np.int32)
        gstart = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        capacity = int(rng.integers(1, 14))
        order, calls = kernels.wave_order(keys, gstart, 12, capacity)
        want_order, want_calls = [], []
        for a, b in zip(gstart[:-1].tolist(), gstart[1:].tolist()):
            for wave in wave_positions(keys[a:b].tolist(), capacity):
                want_calls.append(len(want_order))
                want_order += [a + i for i in wave]
        assert order.tolist() == want_order and calls.tolist() == [*want_calls, len(keys)]


def test_byte_budget_when_expert_sizes_differ():
    shape = ModelShape("mixed", mixtral().shape.layers, 8, 2, [100 if layer % 2 else 300 for layer in range(32)])
    t = dataclasses.replace(mixtral(), shape=shape)  # the cached trace itself stays as imported
    for budget in (1200, 6400, 20000):
        res = replay(t, "lru", budget)
        assert res.slots is None and res.hits == naive_byte_lru(t, budget)
        assert res.bytes_read == sum(m * b for m, b in zip(res.misses_per_layer, shape.expert_bytes))
        assert replay(t, "belady", budget).hits >= res.hits
    with pytest.raises(WeightstreamError, match="below the 600 bytes one layer of one step needs"):
        replay(t, "lru", 599)
    with pytest.raises(WeightstreamError, match="experts of one size"):
        replay(t, "lru", 6400, method="fast")


def naive_byte_lru(trace, budget):
    size = dict(zip(trace.shape.layers, trace.shape.expert_bytes))
    order, hits = [], 0
    for g, layer in enumerate(trace.group_layer.tolist()):
        keys = [(layer, e) for e in trace.experts[trace.group_offsets[g] : trace.group_offsets[g + 1]].tolist()]
        for k in keys:
            if k in order:
                hits += 1
                order.remove(k)
            else:
                while sum(size[c[0]] for c in order) + size[layer] > budget:
                    order.remove(next(c for c in order if c not in keys))
            order.append(k)
    return hits


def test_replay_api_counts_judged_part_and_accepts_options():
    t = mixtral()
    full = replay(t, "lru", t.shape.working_set_bytes)
    assert full.accesses == t.n_accesses and full.tokens == t.n_tokens
    half = replay(t, "lru", t.shape.working_set_bytes, train_share=0.5)
    assert half.accesses == t.n_accesses - t.access_range(0, t.first_step_of_request(2))[1]
    pinned = replay(t, "pinned", 10 * t.shape.expert_bytes[0], pinned_keys=[(0, 0), (0, 1)])
    assert (
        pinned.hits
        >= sum(
            1
            for g in np.flatnonzero(t.group_layer == 0)
            for e in t.experts[t.group_offsets[g] : t.group_offsets[g + 1]]
            if e < 2
        )
        - 2
    )
    two_x = 2 * t.shape.working_set_bytes
    assert replay(t, "slru", two_x, protected_share=0.9).hits != replay(t, "slru", two_x).hits
    with pytest.raises(WeightstreamError, match="holds no expert slot"):
        replay(t, "lru", t.shape.expert_bytes[0] - 1)
    assert replay(t, "lru", t.shape.expert_bytes[0]).hits == 0  # one slot: served one expert at a time
    with pytest.raises(WeightstreamError, match="leaves no training"):
        replay(deepseek(1), "pinned", 10**12, train_share=0.5)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, check=False
    )


def test_simulate_cli_json_table_and_plot(tmp_path):
    t = mixtral()
    save(t, tmp_path / "m.npz")
    res = _cli(
        "simulate", str(tmp_path / "m.npz"), "--json", "--sizes", "1x,2x,40GiB", "--plot", str(tmp_path / "p.png")
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) == {"tokens", "accesses", "working_set_bytes", "results"} and len(out["results"]) == 18
    assert out["working_set_bytes"] == 64 * 336 * 2**20
    w = Workload(t, 0.5)
    assert out["tokens"] == w.judged_tokens and out["accesses"] == t.n_accesses - w.count_from
    for r in out["results"]:
        assert set(r) == {"policy", "cache_bytes", "hits", "misses", "hit_rate", "bytes_per_token"}
        assert r["hits"] + r["misses"] == out["accesses"]
        assert r["bytes_per_token"] == pytest.approx(r["misses"] * 336 * 2**20 / out["tokens"])
        assert r == run_one(w, r["policy"], r["cache_bytes"], Options()).to_json()
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = _cli("simulate", str(tmp_path / "m.npz"), "--policies", "lru,belady", "--sizes", "1x:2x:0.5x")
    assert table.returncode == 0 and table.stdout.count("belady") == 3 and "MiB/token" in table.stdout
    bad = _cli("simulate", str(tmp_path / "m.npz"), "--sizes", "0.01x")
    assert bad.returncode == 2 and "holds no expert slot" in bad.stderr


def test_sizes_in_bytes_multiples_and_ranges():
    from weightstream.sim.sizes import parse_sizes

    assert parse_sizes("1x, 0.5x,4500MiB,2GiB,1.5GB,123", 1000) == [
        1000,
        500,
        4500 * 2**20,
        2 * 2**30,
        1_500_000_000,
        123,
    ]
    assert parse_sizes("0.5x:8x:0.5x", 2574)[1::2] == [2574 * m for m in range(1, 9)]  # lands exactly on 1x, 2x...
    assert parse_sizes("1GiB:3GiB:1GiB", 1) == [2**30, 2 * 2**30, 3 * 2**30]
    for bad in ("", "foo", "2 parsecs", "-1x", "4x:1x:1x", "0x"):
        with pytest.raises(WeightstreamError):
            parse_sizes(bad, 1000)
    with pytest.raises(WeightstreamError, match="protected share"):
        Options(protected_share=1.5)
