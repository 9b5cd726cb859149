"""tune's search: it counts what the simulator counts, replays what the engine replays, and recommends by rule."""

import dataclasses

import pytest
import torch

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.engine.routing import RoutingRecorder, RoutingReplay
from weightstream.sim.advice import llamacpp_advice, recommend, verdict
from weightstream.sim.budget import Budget
from weightstream.sim.overlap_model import CostParams
from weightstream.sim.replay import Options, access_hits, run_one
from weightstream.sim.tune import Config, ModelFacts, Search, cache_sizes
from weightstream.sim.workload import Workload
from weightstream.trace import ModelShape
from weightstream.trace.remap import onto_shape, token_rows, trace_steps
from weightstream.units import GIB, MIB

from _real_traces import deepseek, mixtral

EXPERT = 12 * MIB
OLMOE16 = ModelShape("olmoe16", list(range(16)), 64, 8, [EXPERT] * 16)
FACTS = ModelFacts(16, 64, 8, EXPERT, EXPERT + 8192, EXPERT + 4096, 16 * 8 * (EXPERT + 8192))
PARAMS = CostParams(0.05, 0.001, 0.0008, 0.00005, 0.001, 0.0008, 0.00002, 0.003)


@pytest.fixture(scope="module")
def replayed():
    return onto_shape(deepseek(4), OLMOE16)


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu", "pinned", "adaptive", "belady"])
def test_search_counts_the_misses_simulate_counts(replayed, policy):
    search = Search(replayed, FACTS, PARAMS)
    size = int(1.5 * FACTS.working_set_bytes)
    config = search.expert_cache(policy, size)
    hit = run_one(Workload(replayed, 0.0), policy, config.slots * EXPERT, search.options)
    assert config.slots == size // FACTS.slot_bytes
    hits = access_hits(search.w, policy, config.slots * EXPERT, search.options)
    assert (int(hits.sum()), int((~hits).sum())) == (hit.hits, hit.misses)
    assert int(search.steps.load(hits).misses.sum()) == hit.misses


def test_adaptive_decides_as_the_runtime_does_with_a_foreign_top_k(replayed):
    search = Search(replayed, FACTS, PARAMS)  # trace top-6 on a top-8 model
    slots = int(1.7 * 16 * 6)  # above 1.8x of the trace's working set, below 1.8x of the model's
    adaptive = search.expert_cache("adaptive", slots * FACTS.slot_bytes)
    lru = search.expert_cache("lru", slots * FACTS.slot_bytes)
    assert (adaptive.hit_rate, adaptive.mib_read_per_token) == (lru.hit_rate, lru.mib_read_per_token)
    assert search.options.threshold == pytest.approx(1.8 * 8 / 6)


def test_a_bigger_lru_cache_never_predicts_slower(replayed):
    search = Search(replayed, FACTS, PARAMS)
    speeds = [search.expert_cache("lru", s).predicted_decode_tokens_per_s for s in cache_sizes(FACTS, 40 * GIB)]
    assert speeds == sorted(speeds) and speeds[-1] > speeds[0]


def test_cache_sizes_go_from_one_working_set_to_the_budget():
    sizes = cache_sizes(FACTS, int(3.3 * FACTS.working_set_bytes))
    assert sizes[0] == FACTS.working_set_bytes and sizes[-1] == int(3.3 * FACTS.working_set_bytes)
    assert len({s // FACTS.slot_bytes for s in sizes}) == len(sizes)


def test_the_engine_replays_what_onto_shape_builds(tiny_model):
    source = mixtral(("gsm8k_2_routing.jsonl",))
    model = load_streaming_model(tiny_model("mixtral"), expert_cache="2x", io_threads=2)
    runtime = model.weightstream
    runtime.routing_override = RoutingReplay(source, runtime.layout)
    recorder = RoutingRecorder(runtime.layout, "tiny-mixtral")
    runtime.routing_observer = recorder
    generate(model, torch.arange(3, 8).unsqueeze(0), 6)  # a 5-token prefill step, then decode
    generate(model, torch.arange(3, 5).unsqueeze(0), 4)
    runtime.close()
    recorded = recorder.finish()
    built = onto_shape(source, recorded.shape, trace_steps(recorded))
    assert (built.experts == recorded.experts).all() and (built.group_offsets == recorded.group_offsets).all()
    assert (token_rows(built) == token_rows(recorded)).all()


def _config(path, policy, tok_s, size=GIB, bound=False):
    return Config(path, policy, size, 100, 0.5, 100.0, tok_s, 1.0, bound)


def test_recommend_prefers_lru_within_one_percent_else_the_fastest():
    configs = [
        _config("expert-cache", "slru", 10.0),
        _config("expert-cache", "lru", 9.95),
        _config("page-cache", "k", 5),
    ]
    assert recommend(configs)[0].policy == "lru"
    configs[1].predicted_decode_tokens_per_s = 9.5
    assert recommend(configs)[0].policy == "slru"
    configs.append(_config("expert-cache", "belady", 20.0, bound=True))  # the bound is never recommended
    assert recommend(configs)[0].policy == "slru"


def test_verdict_says_when_the_expert_cache_loses():
    configs = [_config("expert-cache", "lru", 2.69), _config("page-cache", "kernel", 3.97)]
    v = verdict(configs)
    assert v.winner == "page-cache" and "LOSES" in v.line and recommend(configs)[0].path == "page-cache"
    configs[1].predicted_decode_tokens_per_s = 2.8
    assert verdict(configs).winner == "tie"
    # the gpt-oss lesson: a small expert cache loses to a page cache that uses all free memory, a big one wins
    configs = [
        _config("expert-cache", "lru", 2.69, size=2 * GIB),
        _config("expert-cache", "slru", 2.5, size=2 * GIB),
        _config("expert-cache", "lru", 4.6, size=5 * GIB),
        _config("page-cache", "kernel", 3.97, size=5 * GIB),
    ]
    v = verdict(configs)
    assert v.winner == "expert-cache" and v.loses_up_to_bytes == 2 * GIB
    assert "an expert cache of 2.0 GiB or less loses to it" in v.line


def test_n_cpu_moe_keeps_on_the_cpu_the_layers_the_gpu_cannot_hold():
    # mixtral-8x7b shape: 32 layers of 8 experts of 336 MiB
    facts = ModelFacts(32, 8, 2, 336 * MIB, 336 * MIB + 8192, 336 * MIB, 64 * 336 * MIB)
    budget = Budget(64 * GIB, 3 * GIB, GIB // 2, GIB // 2, 21 * GIB, 4096)
    page = _config("page-cache", "kernel", None)
    lines = llamacpp_advice(facts, budget, page, 24 * GIB, verdict([page]))
    layer = 8 * 336 * MIB
    on_gpu = (24 * GIB - 3 * GIB - GIB // 2 - 512 * MIB) // layer
    assert f"--n-cpu-moe {32 - on_gpu}:" in lines[1]
    assert "not predicted: llama.cpp's own tok/s" in lines[-1]
    assert any("--no-repack" in line for line in lines)  # 84 GiB of experts in 21 GiB: a repacked GGUF would not fit
    roomy = Budget(128 * GIB, 3 * GIB, GIB // 2, GIB // 2, 90 * GIB, 4096)
    assert not any("--no-repack" in line for line in llamacpp_advice(facts, roomy, page, None, verdict([page])))
    assert "pass --gpu-memory" in llamacpp_advice(facts, budget, page, None, verdict([page]))[1]


def test_a_gpu_too_small_for_the_dense_weights_gets_no_n_cpu_moe():
    """1 GiB of GPU memory cannot hold 3 GiB of dense weights: no layer count, and the line says why (it used to
    say `--n-cpu-moe 32: 1.0 GiB of GPU memory holds the dense weights`)."""
    facts = ModelFacts(32, 8, 2, 336 * MIB, 336 * MIB + 8192, 336 * MIB, 64 * 336 * MIB)
    budget = Budget(64 * GIB, 3 * GIB, GIB // 2, GIB // 2, 21 * GIB, 4096)
    page = _config("page-cache", "kernel", None)
    line = llamacpp_advice(facts, budget, page, GIB, verdict([page]))[1]
    assert "-ngl 99 --n-cpu-moe" not in line and "holds the dense weights" not in line
    assert "1.0 GiB of GPU memory is less than the dense weights and KV (3.5 GiB)" in line
    just = 3 * GIB + GIB // 2 + 512 * MIB  # dense, KV and the allowance exactly: every layer's experts on the CPU
    assert "--n-cpu-moe 32:" in llamacpp_advice(facts, budget, page, just, verdict([page]))[1]


def test_options_default_threshold_on_a_matching_trace():
    trace = onto_shape(deepseek(1), ModelShape("ds-like", list(range(16)), 64, 6, [EXPERT] * 16))
    facts = ModelFacts(16, 64, 6, EXPERT, EXPERT, EXPERT, 16 * 6 * EXPERT)
    assert Search(trace, facts, PARAMS).options.threshold == Options().threshold


def _laid_out(facts: ModelFacts, gap: int) -> ModelFacts:
    """`facts` with every layer's experts in one file, `gap` bytes apart."""
    step = facts.expert_nbytes + gap
    spans = tuple(
        tuple(((layer, e * step, e * step + facts.expert_nbytes),) for e in range(facts.n_experts))
        for layer in range(facts.layers)
    )
    return dataclasses.replace(facts, spans=spans, file_bytes=(facts.n_experts * step,) * facts.layers)


def test_page_cache_over_byte_ranges_sees_readahead_that_helps_and_readahead_that_only_reads():
    """Mixtral's routing on the OLMoE shape uses experts 0-7 of each layer. Stored next to each other, the
    readahead past one expert brings in the next: fewer bytes read, and faster, than stored far apart, where
    readahead is only read. Without the checkpoint's byte ranges there is no page-cache model."""
    trace = onto_shape(mixtral(), OLMOE16)
    params = dataclasses.replace(PARAMS, page_cached_per_byte=1.7)
    room = int(0.9 * 128 * EXPERT)  # less than the 128 experts the routing uses
    near = Search(trace, _laid_out(FACTS, 0), params).page_cache(room)
    far = Search(trace, _laid_out(FACTS, 64 * MIB), params).page_cache(room)
    assert near.policy == far.policy == "kernel (two-list model)"
    assert near.mib_read_per_token < far.mib_read_per_token
    assert near.predicted_decode_tokens_per_s > far.predicted_decode_tokens_per_s
    with pytest.raises(ValueError, match="byte ranges"):
        Search(trace, FACTS, params).page_cache(room)


def _with_dense(facts: ModelFacts, per_layer: int) -> ModelFacts:
    """`facts` laid out with a dense span of `per_layer` bytes per layer in a file of its own, and a head of as much."""
    dense_file = facts.layers  # file id after the layers' expert files
    spans = tuple(((dense_file, i * per_layer, (i + 1) * per_layer),) for i in range(facts.layers + 1))
    return dataclasses.replace(facts, dense_spans=spans, file_bytes=(*facts.file_bytes, (facts.layers + 1) * per_layer))


def test_the_page_cache_model_reads_dense_weights_again_when_the_room_is_too_small_for_them():
    """Each step reads every layer's dense weights beside its experts, in the same lists. With room for all of it
    they are read once and decode reads what the experts alone read; where the experts thrash the room, the
    kernel evicts the dense weights too and every step reads them again."""
    trace = onto_shape(mixtral(), OLMOE16)
    params = dataclasses.replace(PARAMS, page_cached_per_byte=1.0)
    laid = _laid_out(FACTS, 64 * MIB)
    dense = _with_dense(laid, 32 * MIB)
    dense_mib = 17 * 32
    roomy = 1024 * EXPERT
    alone, beside = (Search(trace, f, params).page_cache(roomy) for f in (laid, dense))
    assert beside.hit_rate == alone.hit_rate
    assert beside.mib_read_per_token == alone.mib_read_per_token
    tight = 16 * EXPERT  # an eighth of the 128 experts the routing uses: everything thrashes
    alone, beside = (Search(trace, f, params).page_cache(tight) for f in (laid, dense))
    assert beside.mib_read_per_token > alone.mib_read_per_token + 0.9 * dense_mib
    assert beside.predicted_decode_tokens_per_s < alone.predicted_decode_tokens_per_s
