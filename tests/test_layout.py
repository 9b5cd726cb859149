"""Expert layout derived from transformers' conversion mapping, for per-expert and fused on-disk forms."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.layout import build_layout


def meta_model(model_dir):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_expert_pieces_rebuild_the_model_parameters(tiny_model, arch):
    model_dir = tiny_model(arch)
    layout = build_layout(meta_model(model_dir), open_checkpoint(model_dir), top_k=2)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(ref.named_parameters())
    paths = {layer: path for path, layer in layout.module_layers.items()}
    for (layer, expert), ex in layout.experts.items():
        names = [p.name for p in ex.params]
        assert names.index("down_proj") > 0  # gate/up before down: execution order
        for param in ex.params:
            raw = b"".join(_read(p) for p in param.pieces)
            got = torch.frombuffer(bytearray(raw), dtype=param.dtype).view(param.shape)
            assert torch.equal(got, params[f"{paths[layer]}.{param.name}"][expert].detach()), (
                layer,
                expert,
                param.name,
            )


def _read(piece):
    with open(piece.path, "rb") as f:
        f.seek(piece.offset)
        return f.read(piece.nbytes)


def test_dense_architecture_is_refused_with_supported_list(tmp_path):
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(WeightstreamError, match="'llama'.*supported.*qwen3_moe.*mixtral"):
        load_streaming_model(str(tmp_path))


def test_mixtral_keys_are_per_expert_and_gpt_oss_fused(tiny_model):
    for arch, sample in (("mixtral", "experts.0.w1.weight"), ("gpt_oss", "experts.gate_up_proj")):
        keys = set(open_checkpoint(tiny_model(arch)).tensors)
        assert any(k.endswith(sample) for k in keys), arch


@pytest.mark.parametrize(
    "arch, in_place", [("olmoe", True), ("qwen3_moe", True), ("mixtral", False), ("gpt_oss", True)]
)
def test_slot_plans_read_stretches_whole_and_give_each_parameter(tiny_model, arch, in_place):
    """OLMoE/Qwen store down|gate|up adjacent: one read, used in place. Mixtral's w1|w2|w3 puts down between the
    two halves of gate_up: one read per piece, then a pack. Either way the views are the model's parameters."""
    from weightstream.cache.expert_cache import ExpertCache

    model_dir = tiny_model(arch)
    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2)  # every expert resident
    cache = model.weightstream.cache
    ref = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    paths = {layer: path for path, layer in cache.layout.module_layers.items()}
    assert isinstance(cache, ExpertCache)
    for key, plan in cache.plans.items():
        assert (not plan.packs) == in_place, key
        if in_place and arch != "gpt_oss":  # gpt_oss: weights and biases live in different tensors, two stretches
            assert len(plan.requests) == 1, key
        assert plan.slot_bytes <= cache.slot_bytes
    for layer, expert in cache.layout.experts:
        fetch = cache.fetch_layer(layer, [expert])
        for _ in fetch.missing:
            cache.wait(fetch)
        for name, value in cache.params(layer, expert).items():
            assert torch.equal(value, ref[f"{paths[layer]}.{name}"][expert].detach()), (layer, expert, name)
    model.weightstream.close()
