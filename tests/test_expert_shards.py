"""Experts computed by shards that hold them (engine/shards.py; issue 51, a first step): a head whose experts are
split over shards decodes bitwise the tokens and logits of one process, in this process and over Ray actors, and
never asks its own cache for an expert a shard holds."""

import json
import threading

import pytest
import torch

from weightstream.engine.loader import load_streaming_model
from weightstream.engine.shards import ExpertShard, ShardedExperts, place, shard_actors
from weightstream.errors import WeightstreamError
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
        owners = {k: s for s, keys in zip(shards, placement) for k in keys}
        sharded = ShardedExperts(owners, lambda shard, *args: shard.contribute(*args), lambda rows: rows)
        tokens, logits, asked = sharded_run(native_model, sharded)
    finally:
        for s in shards:
            s.close()
    want_tokens, want_logits = one_process
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert not asked & set(owners), "the head's cache was asked for an expert a shard holds"


def test_shards_as_ray_actors_give_bitwise_the_one_process_tokens(native_model, one_process):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sharded = shard_actors(native_model, placements(native_model)["two shards hold every expert"])
        tokens, logits, asked = sharded_run(native_model, sharded)
    finally:
        ray.shutdown()
    want_tokens, want_logits = one_process
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert not asked, "the head's cache was asked for an expert while the shards hold them all"


def test_a_shard_refuses_experts_it_cannot_compute_and_leaves_nothing_running(tiny_model, native_model):
    with pytest.raises(WeightstreamError, match=r"has no expert \(0, 999\)"):
        ExpertShard(native_model, [(0, 999)])
    with pytest.raises(WeightstreamError, match="shards compute the native GGML-block kernels only"):
        ExpertShard(tiny_model("olmoe", "bf16"), [(0, 0)])
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ws-")]


def test_generate_with_expert_shards_gives_the_tokens_of_one_process(native_model):
    """`generate --expert-shards 2` (a local Ray cluster started and stopped by the command): the same tokens, and
    --json says which shard held which experts."""
    args = ("generate", native_model, "--prompt-ids", "3,17,101,250", "--max-new-tokens", "6", "--json")
    code, out, err = ran_in_process(*args)
    assert code == 0, err
    code, sharded_out, err = ran_in_process(*args, "--expert-shards", "2")
    assert code == 0, err
    plain, sharded = json.loads(out), json.loads(sharded_out)
    assert sharded["token_ids"] == plain["token_ids"] and plain["stats"]["expert_shards"] is None
    held = [tuple(k) for keys in sharded["stats"]["expert_shards"].values() for k in keys]
    assert len(sharded["stats"]["expert_shards"]) == 2
    assert sorted(held) == sorted(map_model(native_model).layout.experts)  # every expert on exactly one shard


def test_bad_shard_options_are_refused_before_loading(native_model):
    code, err = refused_in_process("generate", native_model, "--prompt-ids", "1", "--expert-shards", "-1")
    assert code == 2 and "--expert-shards -1: give 1 or more shards" in err, err
    code, err = refused_in_process("generate", native_model, "--prompt-ids", "1", "--ray-address", "auto")
    assert code == 2 and "--ray-address places expert shards: give --expert-shards N with it" in err, err


def test_placement_spreads_each_layers_experts_and_their_heat():
    keys = [(layer, e) for layer in (1, 3) for e in range(8)]
    even = place(keys, 3)
    assert sorted(k for shard in even for k in shard) == keys
    for layer in (1, 3):
        counts = [sum(1 for k in shard if k[0] == layer) for shard in even]
        assert max(counts) - min(counts) <= 1, counts
    heat = {k: (100.0 if k[1] == 0 else 1.0) for k in keys}  # one hot expert a layer: alone on its shard
    hot = place(keys, 2, heat)
    for layer in (1, 3):
        with_hot = next(shard for shard in hot if (layer, 0) in shard)
        assert [k for k in with_hot if k[0] == layer] == [(layer, 0)], hot
    with pytest.raises(WeightstreamError, match="give 1 or more shards"):
        place(keys, 0)
