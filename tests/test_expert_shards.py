"""Experts computed by shards that hold them (engine/shards.py, shard_ray.py; issue 51): a head whose experts are
split over shards decodes bitwise the tokens and logits of one process, in this process and over Ray actors (compiled
graphs or actor calls), never asks its own cache for an expert a shard holds, reads from disk what no shard has room
for, and carries on with the same tokens when a shard is killed mid-run, taking it back once Ray has restarted it."""

import json
import os
import signal
import threading
import time

import pytest
import torch

from weightstream.cgroup import margin_for
from weightstream.engine.loader import load_streaming_model
from weightstream.engine.shard_ray import ShardOptions, start_shards
from weightstream.engine.shards import ExpertShard, LocalLink, ShardDown, ShardedExperts, heat_from_trace
from weightstream.errors import WeightstreamError
from weightstream.sim.placement import copies, place
from weightstream.store.model import map_model
from weightstream.store.quant.pipeline import quantize_checkpoint

from cli_support import ran_in_process, refused_in_process
from engine_support import greedy_logits


@pytest.fixture(scope="module")
def native_model(tiny_model, tmp_path_factory):
    """The tiny OLMoE with its experts as Q8_0 blocks: the native kernels, which run a layer in one call."""
    out = str(tmp_path_factory.mktemp("shards") / "q8")
    quantize_checkpoint(tiny_model("olmoe", "bf16"), out, 8)
    return out


@pytest.fixture(scope="module")
def one_process(native_model):
    model = load_streaming_model(native_model, expert_cache="2x", io_threads=2)
    try:
        return greedy_logits(model)
    finally:
        model.weightstream.close()


def placements(model_dir: str) -> dict[str, list[list[tuple[int, int]]]]:
    keys = sorted(map_model(model_dir).layout.experts)
    return {
        "two shards hold every expert": [[k for k in keys if k[1] % 2 == 0], [k for k in keys if k[1] % 2 == 1]],
        "one shard holds the first layer, the head the rest": [[k for k in keys if k[0] == keys[0][0]]],
    }


def sharded_run(model_dir: str, sharded: ShardedExperts) -> tuple[list, list, set]:
    """(tokens, logits, keys the head's own cache was asked for) of the greedy run with `sharded` as the shards."""
    model = load_streaming_model(model_dir, expert_cache="2x", io_threads=2)
    asked = set()
    cache = model.weightstream.cache
    fetch = cache.fetch_layer

    def recorded(layer, experts):
        asked.update((layer, e) for e in experts)
        return fetch(layer, experts)

    cache.fetch_layer = recorded
    model.weightstream.shards = sharded
    try:
        tokens, logits = greedy_logits(model)
    finally:
        model.weightstream.close()
    return tokens, logits, asked


@pytest.mark.parametrize("how", ["two shards hold every expert", "one shard holds the first layer, the head the rest"])
def test_shards_in_this_process_give_bitwise_the_one_process_tokens(native_model, one_process, how):
    placement = placements(native_model)[how]
    shards = [ExpertShard(native_model, keys) for keys in placement]
    try:
        sharded = ShardedExperts([LocalLink(s) for s in shards])
        tokens, logits, asked = sharded_run(native_model, sharded)
    finally:
        for s in shards:
            s.close()
    want_tokens, want_logits = one_process
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert not asked & {k for keys in placement for k in keys}, "the head's cache was asked for an expert a shard holds"
    hidden = json.load(open(os.path.join(native_model, "config.json")))["hidden_size"]
    traffic = sharded.report()  # float32 rows of the hidden size back, one per (token, k) row it computed
    assert all(t["round_trips"] > 0 and t["rows"] > 0 and t["bytes_in"] == t["rows"] * 4 * hidden for t in traffic)


@pytest.mark.parametrize("budget", ["no room for any expert", "room for some"])
def test_a_shard_short_of_memory_keeps_the_hottest_it_has_room_for_and_the_head_reads_the_rest(
    native_model, one_process, budget
):
    keys = sorted(map_model(native_model).layout.experts)
    offered = list(reversed(keys))  # "hottest first": the last keys
    slot = map_model(native_model).layout.slot_bytes
    # beside what this process holds now (the shard measures itself once loaded, so the room is its own figure: in a
    # long test session this process may hold more than the budget's estimate, and the shard then keeps none)
    memory = 2**20 if budget.startswith("no") else int((psutil_rss() + 12 * slot + 48 * 2**20) / 0.98)
    shard = ExpertShard(native_model, offered, memory=memory)
    try:
        room = max(0, (memory - margin_for(memory) - shard.base_bytes) // slot)
        assert shard.resident() == sorted(offered[:room])
        assert budget != "no room for any expert" or room == 0
        assert shard.report()["cgroup"] == "not confined"  # no cgroup name given: this test process stays put
        tokens, logits, asked = sharded_run(native_model, ShardedExperts([LocalLink(shard)]))
    finally:
        shard.close()
    assert tokens == one_process[0] and all(torch.equal(a, b) for a, b in zip(logits, one_process[1]))
    assert not asked & set(shard.resident()), "the head's cache was asked for an expert the shard holds"
    assert asked <= set(keys) - set(shard.resident()), "the head reads what the shard does not hold, nothing else"
    assert bool(asked) == (room < len(offered)), "the head reads when, and only when, the shard is short of room"


class SwitchedLink(LocalLink):
    """A shard in this process that can be switched off: sends then fail as a dead actor's do, and it answers again
    (`alive`) only once switched back on (the head's own path for a shard that died and came back)."""

    def __init__(self, shard: ExpertShard):
        super().__init__(shard)
        self.dead = False

    def send(self, request):
        if self.dead:
            raise ShardDown("switched off")
        return super().send(request)

    def alive(self):
        return None if self.dead else super().alive()


def test_replicated_experts_are_computed_once_by_one_copy_and_a_dead_shards_copies_serve(native_model, one_process):
    """Every expert on both shards: each (token, k) row is computed once, the rows spread over the two copies, the
    tokens bitwise one process's; shard 0 switched off: shard 1 computes everything (the head's cache is asked for
    nothing), the plan is re-made once when it goes down and once when it is back."""
    keys = sorted(map_model(native_model).layout.experts)
    own = place(keys, 2, how="spread")
    plan = [a + b for a, b in zip(own, copies(own, len(keys)))]
    assert all(sorted(shard) == keys for shard in plan)
    home = {k: i for i, shard in enumerate(own) for k in shard}
    single = [ExpertShard(native_model, keys) for keys in placements(native_model)["two shards hold every expert"]]
    try:
        once = ShardedExperts([LocalLink(s) for s in single])
        sharded_run(native_model, once)
    finally:
        for s in single:
            s.close()
    rows = sum(t.rows for t in once.stats)
    shards = [ExpertShard(native_model, keys) for keys in plan]
    try:
        links = [SwitchedLink(s) for s in shards]
        changes = []
        sharded = ShardedExperts(links, on_change=lambda: changes.append([t.up for t in sharded.stats]), home=home)
        tokens, logits, asked = sharded_run(native_model, sharded)
        assert tokens == one_process[0] and all(torch.equal(a, b) for a, b in zip(logits, one_process[1]))
        assert not asked and sum(t.rows for t in sharded.stats) == rows, "a row computed twice, or by the head"
        assert all(t.rows > 0 for t in sharded.stats), "a replicated expert's rows go to its home shard"
        links[0].dead = True
        before = sharded.stats[1].rows
        tokens, logits, asked = sharded_run(native_model, sharded)
        assert tokens == one_process[0] and all(torch.equal(a, b) for a, b in zip(logits, one_process[1]))
        assert not asked, "a dead shard's experts come from their live copies, not the head's reads"
        assert sharded.stats[1].rows - before == rows and sharded.stats[0].failures == 1
        assert changes == [[False, True]]
        links[0].dead = False
        sharded_run(native_model, sharded)
        assert changes == [[False, True], [True, True]] and sharded.stats[0].readmitted == 1
    finally:
        for s in shards:
            s.close()


def test_a_shard_found_dead_when_asked_hands_its_experts_to_copies_on_a_shard_not_asked(native_model, one_process):
    """The first layer on shard 0, the others on shard 1, every expert copied onto the other: shard 0 dies unseen
    (still counted up), so its first request fails; its experts go to shard 1's copies in that very layer, though
    shard 1 holds none of that layer's own share and was not asked there; the head's cache is asked for nothing."""
    keys = sorted(map_model(native_model).layout.experts)
    own = placements(native_model)["one shard holds the first layer, the head the rest"]
    own.append(sorted(set(keys) - set(own[0])))  # shard 1: every other layer
    home = {k: i for i, shard in enumerate(own) for k in shard}
    shards = [ExpertShard(native_model, a + b) for a, b in zip(own, copies(own, len(keys)))]
    try:
        links = [SwitchedLink(s) for s in shards]
        sharded = ShardedExperts(links, home=home)
        links[0].dead = True
        tokens, logits, asked = sharded_run(native_model, sharded)
    finally:
        for s in shards:
            s.close()
    assert tokens == one_process[0] and all(torch.equal(a, b) for a, b in zip(logits, one_process[1]))
    assert not asked and sharded.stats[0].failures == 1
    assert [t.fallback_rows for t in sharded.stats] == [0, 0] and sharded.stats[0].rows == 0


def psutil_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.parametrize("transport", ["graph", "calls"])
def test_shards_as_ray_actors_give_bitwise_the_one_process_tokens(native_model, one_process, ray_cluster, transport):
    offered = placements(native_model)["two shards hold every expert"]
    sharded = start_shards(native_model, offered, ShardOptions(shards=2, transport=transport))
    try:
        tokens, logits, asked = sharded_run(native_model, sharded)
    finally:
        sharded.close()
    want_tokens, want_logits = one_process
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert not asked, "the head's cache was asked for an expert while the shards hold them all"
    assert all(t["up"] and t["failures"] == 0 and t["round_trips"] > 0 for t in sharded.report())


def test_a_shard_killed_mid_run_costs_no_answer_its_copies_serve_and_it_comes_back(
    native_model, one_process, ray_cluster
):
    """Every expert on both shards (its own share and a copy of the other's), shard 0's process SIGKILLed before the
    fifth layer: the head computes what it had asked shard 0 for in that layer only (the same tokens), every later
    layer's experts go to shard 1's copies, Ray restarts shard 0, and the head takes it back and sends it rows again.
    (The head computing a dead shard's experts with no copy: the serve test below.)"""
    keys = sorted(map_model(native_model).layout.experts)
    own = place(keys, 2, how="spread")
    home = {k: i for i, shard in enumerate(own) for k in shard}
    offered = [a + b for a, b in zip(own, copies(own, len(keys)))]
    sharded = start_shards(native_model, offered, ShardOptions(shards=2, timeout_s=30), home)
    pid = sharded.links[0].report()["pid"]
    model = load_streaming_model(native_model, expert_cache="2x", io_threads=2)
    calls, asked_in = 0, set()
    fetch = model.weightstream.cache.fetch_layer

    def kill_on_the_fifth_layer(layer, index, weights):
        nonlocal calls
        calls += 1
        if calls == 5:
            os.kill(pid, signal.SIGKILL)

    def recorded(layer, experts):
        asked_in.add(calls)
        return fetch(layer, experts)

    model.weightstream.cache.fetch_layer = recorded
    model.weightstream.routing_observer = kill_on_the_fifth_layer
    model.weightstream.shards = sharded
    try:
        tokens, logits = greedy_logits(model)
        down = sharded.report()[0]
        assert tokens == one_process[0] and all(torch.equal(a, b) for a, b in zip(logits, one_process[1]))
        assert down["failures"] == 1 and down["fallback_rows"] > 0, down  # (it may be back already: Ray is quick)
        assert asked_in <= {5} and calls > 5, asked_in  # the head read only in the layer the kill interrupted
        deadline = time.monotonic() + 120
        while not sharded.stats[0].up and time.monotonic() < deadline:  # Ray restarts it; the head polls it
            sharded._readmit()
            time.sleep(0.2)
        assert sharded.stats[0].up, "the restarted shard was not taken back within 2 minutes"
        assert sharded.links[0].report()["pid"] != pid
        rows_before = sharded.stats[0].rows
        again, _ = greedy_logits(model)
        assert again == one_process[0] and sharded.stats[0].rows > rows_before
        assert sharded.report()[0]["readmitted"] == 1
    finally:
        model.weightstream.close()
        sharded.close()


def test_a_shard_refuses_experts_it_cannot_compute_and_leaves_nothing_running(tiny_model, native_model):
    with pytest.raises(WeightstreamError, match=r"has no expert \(0, 999\)"):
        ExpertShard(native_model, [(0, 999)])
    with pytest.raises(WeightstreamError, match="shards compute the native GGML-block kernels only"):
        ExpertShard(tiny_model("olmoe", "bf16"), [(0, 0)])
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ws-")]


def test_generate_with_expert_shards_gives_the_tokens_of_one_process(native_model, tmp_path):
    """`generate --expert-shards 2 --shard-replicas 5` (a local Ray cluster started and stopped by the command): the
    same tokens; the plan (saved with --shard-plan, and in --json) puts every expert on a shard and 5 on both, and
    the head measured each shard's traffic."""
    args = ("generate", native_model, "--prompt-ids", "3,17,101,250", "--max-new-tokens", "6", "--json")
    code, out, err = ran_in_process(*args)
    assert code == 0, err
    plan_file = tmp_path / "plan.json"
    sharded_args = ("--expert-shards", "2", "--shard-plan", plan_file, "--shard-replicas", "5")
    code, sharded_out, err = ran_in_process(*args, *sharded_args)
    assert code == 0, err
    plain, sharded = json.loads(out), json.loads(sharded_out)
    assert sharded["token_ids"] == plain["token_ids"] and plain["stats"]["expert_shards"] is None
    plan = sharded["stats"]["expert_shards"]
    held = [tuple(k) for shard in plan["shards"] for k in shard["held"]]
    assert len(plan["shards"]) == 2 and plan["head_reads"] == []
    experts = sorted(map_model(native_model).layout.experts)
    assert sorted(set(held)) == experts and len(held) == len(experts) + 5  # each expert once, 5 of them twice
    assert plan["replicated"] == 5 and sum(s["copies"] for s in plan["shards"]) == 5
    saved = json.loads(plan_file.read_text())
    assert saved["shards"][0]["held"] == plan["shards"][0]["held"] and saved["transport"] == "graph"
    assert all(t["round_trips"] > 0 and t["bytes_out"] > 0 and t["bytes_in"] > 0 for t in plan["traffic"])
    assert "shard 0:" in err and "head: reads 0 experts from disk; 5 held twice" in err and "of them copies" in err


def test_bad_shard_options_are_refused_before_loading(native_model, tmp_path):
    base = ("generate", native_model, "--prompt-ids", "1")
    cases = {
        ("--expert-shards", "-1"): "--expert-shards -1: give 1 or more shards",
        ("--ray-address", "auto"): "--ray-address places expert shards: give --expert-shards N with it",
        ("--shard-memory", "2GiB"): "--shard-memory places expert shards: give --expert-shards N",
        ("--shard-transport", "calls"): "--shard-transport places expert shards: give --expert-shards N",
        ("--shard-placement", "spread"): "--shard-placement places expert shards: give --expert-shards N",
        ("--shard-delay-us", "200"): "--shard-delay-us places expert shards: give --expert-shards N",
        ("--shard-replicas", "4"): "--shard-replicas places expert shards: give --expert-shards N",
        ("--expert-shards", "1", "--shard-replicas", "4"): "--shard-replicas 4: give 0 or more copies, and 2 or more",
        ("--expert-shards", "2", "--shard-replicas", "-3"): "--shard-replicas -3: give 0 or more copies",
        ("--expert-shards", "2", "--shard-memory", "lots"): "--shard-memory 'lots': not a size",
        ("--expert-shards", "2", "--shard-heat", tmp_path / "none.npz"): "none.npz: no such file",
        ("--expert-shards", "2", "--shard-plan", tmp_path / "no" / "p.json"): "p.json: its directory does not exist",
        ("--expert-shards", "2", "--shard-plan", tmp_path): "is a directory; give a file name",
        ("--expert-shards", "2", "--shard-memory", "600MiB"): "give at least 1GiB",
        ("--expert-shards", "2", "--shard-delay-us", "nan"): "--shard-delay-us nan: give 0 or more microseconds",
        ("--expert-shards", "2", "--ray-address", "127.0.0.1:1"): "--ray-address 127.0.0.1:1: nothing answers there",
    }
    for extra, message in cases.items():
        code, err = refused_in_process(*base, *extra)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (extra, err)


def test_heat_from_a_trace_counts_each_layers_lookups(native_model, tmp_path):
    """A trace recorded on the model itself: each (layer, expert)'s heat is its lookups there."""
    from weightstream.engine.routing import RoutingRecorder
    from weightstream.trace import save

    model = load_streaming_model(native_model, expert_cache="2x", io_threads=2)
    recorder = RoutingRecorder(model.weightstream.layout, "tiny")
    counted: dict = {}

    def both(layer, index, weights):
        recorder(layer, index, weights)
        for e in index.reshape(-1).tolist():
            counted[(layer, e)] = counted.get((layer, e), 0) + 1

    model.weightstream.routing_observer = both
    try:
        greedy_logits(model)
        layout = model.weightstream.layout
    finally:
        model.weightstream.close()
    path = str(tmp_path / "trace.npz")
    save(recorder.finish(), path)
    heat = heat_from_trace(path, layout)
    assert {k: v for k, v in heat.items() if v} == {k: float(v) for k, v in counted.items()}
    hottest = place(sorted(layout.experts), 2, heat)
    assert all(heat[shard[0]] == max(heat[k] for k in shard) for shard in hottest)  # each kept hottest first


def test_placement_spreads_each_layers_experts_and_their_heat():
    keys = [(layer, e) for layer in (1, 3) for e in range(8)]
    even = place(keys, 3, how="spread")
    assert sorted(k for shard in even for k in shard) == keys
    for layer in (1, 3):
        counts = [sum(1 for k in shard if k[0] == layer) for shard in even]
        assert max(counts) - min(counts) <= 1, counts
    heat = {k: (100.0 if k[1] == 0 else 1.0) for k in keys}  # one hot expert a layer: alone on its shard
    hot = place(keys, 2, heat, how="spread")
    for layer in (1, 3):
        with_hot = next(shard for shard in hot if (layer, 0) in shard)
        assert [k for k in with_hot if k[0] == layer] == [(layer, 0)], hot
    with pytest.raises(WeightstreamError, match="give 1 or more shards"):
        place(keys, 0)
    with pytest.raises(WeightstreamError, match="--shard-placement round-robin: one of layers, spread"):
        place(keys, 2, how="round-robin")


def test_placement_copies_the_hottest_experts_onto_another_shard_after_its_own_share():
    keys = [(layer, e) for layer in (1, 3) for e in range(8)]
    heat = {k: float(10 * k[1] + k[0]) for k in keys}  # expert 7 of layer 3 hottest, then 7 of layer 1, ...
    hottest = sorted(keys, key=lambda k: -heat[k])[:4]
    for how in ("layers", "spread"):
        own = place(keys, 3, heat, how)
        extra = copies(own, 4, heat)
        assert sorted(k for shard in extra for k in shard) == sorted(hottest)
        for mine, more in zip(own, extra):
            assert not set(more) & set(mine) and more == sorted(more, key=lambda k: -heat[k])
    # layers: each layer's hottest copied onto the shard that holds none of that layer
    own = place(keys, 2, heat, "layers")  # shard 0: layer 1, shard 1: layer 3
    assert copies(own, 2, heat) == [[(3, 7)], [(1, 7)]]
    with pytest.raises(WeightstreamError, match="--shard-replicas 2: .* 2 or more shards"):
        copies(place(keys, 1), 2)
    with pytest.raises(WeightstreamError, match="--shard-replicas -1: give 0 or more"):
        copies(own, -1)


def test_placement_by_layers_gives_each_shard_consecutive_layers_hottest_first():
    keys = [(layer, e) for layer in (1, 2, 3, 4) for e in range(6)]
    heat = {k: float(k[1]) for k in keys}
    plan = place(keys, 2, heat)  # the default: layers
    assert [sorted({k[0] for k in shard}) for shard in plan] == [[1, 2], [3, 4]]
    assert all([heat[k] for k in shard] == sorted((heat[k] for k in shard), reverse=True) for shard in plan)
    uneven = place(keys, 5)  # 24 experts over 5 shards: 4 or 5 each, a layer split between two at most
    assert sorted(len(shard) for shard in uneven) == [4, 5, 5, 5, 5]
    assert sorted(k for shard in uneven for k in shard) == keys


def test_serve_with_expert_shards_answers_as_one_process_and_through_a_shards_death(native_model, tmp_path):
    """`serve --expert-shards 2`: completions equal plain serve's; /metrics per shard; shard 0's process killed
    between requests: the next answer is the same (the head computes its experts), the shard counted down, and taken
    back once Ray has restarted it."""
    import httpx

    from serve_support import metric, serving

    body = {"model": "q8", "prompt": [3, 17, 101, 250], "max_tokens": 6, "temperature": 0}

    def answer(server) -> list:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    common = ("--expert-cache", "2x", "--io-threads", "2", "--served-model-name", "q8")
    with serving(native_model, *common) as server:
        want = answer(server)
    plan = tmp_path / "plan.json"
    with serving(native_model, *common, "--expert-shards", "2", "--shard-plan", str(plan)) as server:
        assert answer(server) == want
        text = httpx.get(f"{server.url}/metrics").text
        for shard in ("0", "1"):
            assert metric(text, "weightstream_shard_up", f'shard="{shard}"') == 1
            assert metric(text, "weightstream_shard_round_trips_total", f'shard="{shard}"') > 0
            assert metric(text, "weightstream_shard_sent_bytes_total", f'shard="{shard}"') > 0
            assert metric(text, "weightstream_shard_received_bytes_total", f'shard="{shard}"') > 0
        assert sum(metric(text, "weightstream_shard_experts", f'shard="{s}"') for s in "01") == len(
            map_model(native_model).layout.experts
        )
        os.kill(json.loads(plan.read_text())["shards"][0]["pid"], signal.SIGKILL)
        assert answer(server) == want
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "weightstream_shard_failures_total", 'shard="0"') == 1
        assert metric(text, "weightstream_shard_fallback_rows_total", 'shard="0"') > 0
        deadline = time.monotonic() + 120
        while metric(text, "weightstream_shard_up", 'shard="0"') != 1 and time.monotonic() < deadline:
            assert answer(server) == want  # each request's layers poll the restarted shard
            time.sleep(0.5)
            text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "weightstream_shard_readmitted_total", 'shard="0"') == 1, text
        rows = metric(text, "weightstream_shard_rows_total", 'shard="0"')
        assert answer(server) == want
        assert metric(httpx.get(f"{server.url}/metrics").text, "weightstream_shard_rows_total", 'shard="0"') > rows
