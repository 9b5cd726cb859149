"""`simulate --shards`: a cluster of expert shards priced from DeepSeek-V2-Lite's real routing (sim/cluster.py)."""

import json

import numpy as np
import pytest

from weightstream.sim.cluster import ClusterSpec, price_cluster
from weightstream.sim.placement import place
from weightstream.trace import save
from weightstream.trace.remap import token_rows

from _real_traces import deepseek
from cli_support import ran_in_process, refused_in_process

MIB = 2**20


def spec(**changes) -> ClusterSpec:
    base = dict(shards=3, shard_memory=2**40, shard_base=512 * MIB, head_cache=0, hidden=2048)
    return ClusterSpec(**{**base, **changes})


def test_shards_with_room_for_every_expert_serve_every_lookup_and_the_head_reads_nothing():
    trace = deepseek(40)
    report = price_cluster(trace, spec(), train_share=0.5)
    assert report["experts_on_shards"] == report["experts"] == 26 * 64
    assert report["share_of_lookups_on_shards"] == 1.0 and report["head_mib_read_per_token"] == 0
    # layers placement: every layer waits on one trip, two where its experts are split between two shards
    assert 26 <= report["round_trips_per_token"] <= 26 + 2 and report["layers_with_a_trip_per_token"] == 26
    # each (token, layer, k) row back in float32; each trip a bf16 row out with its index and weights
    per_token = 26 * 6 * 4 * 2048 + report["round_trips_per_token"] * (2 * 2048 + 12 * 6)
    assert report["network_bytes_per_token"] == pytest.approx(per_token, rel=0.01)
    wire_ms = per_token * 8 / 25e9 * 1e3
    assert report["network_ms_per_token"] == pytest.approx(26 * 0.05 + wire_ms, rel=0.01)


def test_shards_without_room_leave_every_lookup_to_the_head_which_misses_what_its_lru_cannot_hold():
    trace = deepseek(40)
    report = price_cluster(trace, spec(shard_memory=560 * MIB, head_cache=0), train_share=0.5)
    assert report["experts_on_shards"] == 0 and report["round_trips_per_token"] == 0
    assert report["head_misses_per_token"] == 6 * 26  # no cache: every lookup a miss
    judged = token_rows(trace)[np.repeat(trace.step_request, trace.step_tokens) >= 20]
    held = price_cluster(trace, spec(shard_memory=560 * MIB, head_cache=2**40), train_share=0.5)
    distinct = len({(i, int(e)) for row in judged for i, es in enumerate(row) for e in es})
    assert held["head_misses_per_token"] * held["judged_tokens"] == pytest.approx(distinct, rel=1e-3)  # read once


def test_shards_keep_what_fits_beside_their_process():
    trace = deepseek(40)
    expert = max(trace.shape.expert_bytes)
    memory = int((512 * MIB + 100 * expert + 48 * MIB) / 0.98) + 1  # 100 experts each, past the margin
    report = price_cluster(trace, spec(shard_memory=memory), train_share=0.5)
    assert report["experts_per_shard"] == 100 and report["experts_on_shards"] == 300
    # DeepSeek-V2-Lite's routing is balanced: the hottest 18% of experts in 20 prompts serve about 18% of the next 20
    # prompts' lookups (0.17 measured), not a larger share
    assert 0.1 < report["share_of_lookups_on_shards"] < 0.3
    assert place([(0, 1), (0, 2)], 1, {(0, 1): 1.0, (0, 2): 5.0}) == [[(0, 2), (0, 1)]]


def test_simulate_shards_prints_the_price_and_refuses_a_cluster_half_given(tmp_path):
    path = tmp_path / "ds.npz"
    save(deepseek(20), path)
    args = ("simulate", path, "--shards", "3", "--shard-memory", "3GiB", "--hidden", "2048")
    code, out, err = ran_in_process(*args, "--json")
    assert code == 0, err
    report = json.loads(out)["cluster"]
    assert report["shards"] == 3 and 0 < report["share_of_lookups_on_shards"] <= 1
    code, out, err = ran_in_process(*args)
    assert code == 0 and "lookups served by shards" in out and "round trips a token" in out, err
    code, err = refused_in_process("simulate", path, "--shards", "3", "--shard-memory", "3GiB")
    assert code == 2 and "give --shards N, --shard-memory SIZE and --hidden N" in err
    code, err = refused_in_process(*args, "--network-gbps", "0")
    assert code == 2 and "--network-gbps must be positive" in err, err


def test_a_dead_shards_experts_go_to_live_copies_else_to_the_head():
    """`--shard-down` prices the cluster with a shard dead, as the runtime serves it (engine/shards.py's `assign`):
    its experts computed on a live copy where `--shard-replicas` gave one, else read by the head."""
    trace = deepseek(40)
    healthy = price_cluster(trace, spec(), train_share=0.5)
    copied = price_cluster(trace, spec(replicas=300), train_share=0.5)
    assert copied["experts_held_twice"] == 300 and copied["experts_on_shards"] == 26 * 64
    for key in ("share_of_lookups_on_shards", "round_trips_per_token", "network_bytes_per_token"):
        assert copied[key] == healthy[key], key  # while every shard is up its home computes each expert
    own = place(sorted(_heat(trace)), 3, _heat(trace))
    dead = price_cluster(trace, spec(down=(0,)), train_share=0.5)
    assert dead["experts_on_shards"] == 26 * 64 - len(own[0])
    dead_copied = price_cluster(trace, spec(down=(0,), replicas=300), train_share=0.5)
    assert dead_copied["share_of_lookups_on_shards"] > dead["share_of_lookups_on_shards"]
    assert dead_copied["head_mib_read_per_token"] < dead["head_mib_read_per_token"]
    # a copy of every expert: the cluster loses no lookup to one dead shard
    everything = price_cluster(trace, spec(down=(1,), replicas=26 * 64), train_share=0.5)
    assert everything["share_of_lookups_on_shards"] == 1.0 and everything["head_mib_read_per_token"] == 0
    # the copies are dropped first where a shard's memory runs short: its own share is kept whole
    expert = max(trace.shape.expert_bytes)
    memory = int((512 * MIB + (max(map(len, own)) + 10) * expert + 48 * MIB) / 0.98) + 1
    short = price_cluster(trace, spec(shard_memory=memory, replicas=300), train_share=0.5)
    spare = sum(short["experts_per_shard"] - len(share) for share in own)
    assert short["experts_on_shards"] == 26 * 64 and 0 < short["experts_held_twice"] == spare < 300


def _heat(trace):
    from weightstream.sim.placement import heat_counts

    choices = token_rows(trace)[np.repeat(trace.step_request, trace.step_tokens) < 20]
    return heat_counts(choices, list(range(choices.shape[1])), trace.shape.n_experts)


def test_simulate_prices_a_dead_shard_and_refuses_bad_shard_numbers(tmp_path):
    path = tmp_path / "ds.npz"
    save(deepseek(20), path)
    args = ("simulate", path, "--shards", "3", "--shard-memory", "64GiB", "--hidden", "2048")
    code, out, err = ran_in_process(*args, "--shard-replicas", "100", "--shard-down", "0", "--json")
    assert code == 0, err
    report = json.loads(out)["cluster"]
    assert report["down"] == [0] and report["replicas"] == 100 and report["experts_held_twice"] == 100
    code, out, err = ran_in_process(*args, "--shard-down", "2")
    assert code == 0 and "shards down: 2" in out, err
    for bad, message in (("3", "from 0 to 2"), ("0,0", "distinct"), ("x", "separated by commas")):
        code, err = refused_in_process(*args, "--shard-down", bad)
        assert code == 2 and "--shard-down" in err and message in err, (bad, err)
    code, err = refused_in_process(*args, "--shard-replicas", "-1")
    assert code == 2 and "--shard-replicas -1" in err, err
    code, err = refused_in_process("simulate", path, "--shard-down", "0")
    assert code == 2 and "give --shards N" in err, err
