"""Experts computed by shards that hold them (engine/shards.py; issue 51, a first step): a head whose experts are
split over shards decodes bitwise the tokens and logits of one process, in this process and over Ray actors, and
never asks its own cache for an expert a shard holds."""

import pytest
import torch

from weightstream.engine.loader import load_streaming_model
from weightstream.engine.shards import ExpertShard, ShardedExperts, shard_actors
from weightstream.errors import WeightstreamError
from weightstream.store.model import map_model
from weightstream.store.quant.pipeline import quantize_checkpoint

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
        yield greedy_logits(model)
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
    ray = pytest.importorskip("ray")
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


def test_a_shard_refuses_experts_it_cannot_compute(tiny_model, native_model):
    with pytest.raises(WeightstreamError, match=r"has no expert \(0, 999\)"):
        ExpertShard(native_model, [(0, 999)])
    with pytest.raises(WeightstreamError, match="shards compute the native GGML-block kernels only"):
        ExpertShard(tiny_model("olmoe", "bf16"), [(0, 0)])
