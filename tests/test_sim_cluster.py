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
