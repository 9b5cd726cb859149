"""The runtime cache and the simulator agree: replayed real routing gives the hits and misses `simulate` predicts."""

import pytest
import torch

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.engine.routing import RoutingRecorder, RoutingReplay
from weightstream.sim import replay as sim_replay
from weightstream.trace.remap import token_rows

from _real_traces import mixtral


@pytest.fixture(scope="module")
def mixtral_trace():
    return mixtral(("gsm8k_2_routing.jsonl",))


@pytest.mark.parametrize("policy, size", [("lru", "1x"), ("lru", "1.5x"), ("slru", "2x"), ("lfu", "1.5x")])
@pytest.mark.parametrize("prompt_len", [1, 6, 24])  # 6, 24: a batched prefill step too, in waves below 8 slots
def test_engine_counts_what_simulate_predicts(tiny_model, mixtral_trace, policy, size, prompt_len):
    model = load_streaming_model(tiny_model("mixtral"), expert_cache=size, io_threads=2, policy=policy)
    runtime = model.weightstream
    runtime.routing_override = RoutingReplay(mixtral_trace, runtime.layout)
    recorder = RoutingRecorder(runtime.layout, "tiny-mixtral")
    runtime.routing_observer = recorder
    _, stats = generate(model, torch.arange(3, 3 + prompt_len).unsqueeze(0), 24)
    runtime.close()
    recorded = recorder.finish()
    # replay is faithful: each token's choices are the trace's, layer by layer
    source = token_rows(mixtral_trace)[: recorded.n_tokens, :3]
    assert (token_rows(recorded) == source).all()
    sim = sim_replay(recorded, policy, int(float(size[:-1]) * recorded.shape.working_set_bytes))
    assert (sim.hits, sim.misses) == (stats.expert_hits, stats.expert_misses)
    assert stats.expert_misses > 0 and stats.expert_hits > 0


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
def test_a_prompt_in_waves_reads_each_expert_once(tiny_model, mixtral_trace, policy):
    """A 24-token prompt routes to all 8 experts of each of 3 layers: more than the cache's 6 slots, so each layer is
    looked up in waves; an expert is read in one of them and never again in the step."""
    model = load_streaming_model(tiny_model("mixtral"), expert_cache="1x", io_threads=2, policy=policy)
    runtime = model.weightstream
    runtime.routing_override = RoutingReplay(mixtral_trace, runtime.layout)
    recorder = RoutingRecorder(runtime.layout, "tiny-mixtral")
    runtime.routing_observer = recorder
    _, stats = generate(model, torch.arange(3, 27).unsqueeze(0), 1)  # the prompt's step only
    runtime.close()
    recorded = recorder.finish()
    assert recorded.n_steps == 1 and recorded.n_tokens == 24
    groups = list(zip(recorded.group_offsets[:-1].tolist(), recorded.group_offsets[1:].tolist()))
    distinct = [len(set(recorded.experts[a:b].tolist())) for a, b in groups]
    assert distinct == [8, 8, 8] and runtime.cache.n_slots < 8
    assert stats.expert_misses == sum(distinct)
    assert stats.expert_hits == recorded.n_accesses - sum(distinct)
    sim = sim_replay(recorded, policy, recorded.shape.working_set_bytes)
    assert (sim.hits, sim.misses) == (stats.expert_hits, stats.expert_misses)
