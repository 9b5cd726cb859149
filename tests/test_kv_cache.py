"""The engine's KV cache (engine/kv_cache.py) against transformers' DynamicCache: same keys and values, same
generations, in place of concatenation."""

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from weightstream.engine.kv_cache import GrowingLayer, engine_cache, quiet_cache_kwarg


def _states(gen, positions, heads=2, dim=4):
    keys = torch.randn(1, heads, positions, dim, generator=gen)
    return keys, torch.randn(1, heads, positions, dim + 2, generator=gen)  # values may be wider (MLA)


def test_a_layer_holds_what_dynamic_layer_holds_past_its_capacity_and_after_a_crop():
    """Prefill then steps, beyond the capacity hint (it re-allocates), then a crop (transformers reassigns keys: the
    layer starts from what it holds): every step the same keys and values as DynamicLayer's, its keys views of one
    buffer while they fit."""
    gen = torch.Generator().manual_seed(0)
    ours, theirs = GrowingLayer(capacity=6), DynamicLayer()
    steps = [_states(gen, 4)] + [_states(gen, 1) for _ in range(5)]
    for i, (k, v) in enumerate(steps):
        got, want = ours.update(k, v), theirs.update(k, v)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        if i == 1:  # 5 of 6 positions
            buffer = ours.keys.data_ptr()
        if i == 2:  # 6 of 6: written in place
            assert ours.keys.data_ptr() == buffer
    assert ours.get_seq_length() == 9 and ours._key_buffer.shape[2] >= 9
    ours.crop(-3)
    theirs.crop(-3)
    k, v = _states(gen, 2)
    got, want = ours.update(k, v), theirs.update(k, v)
    assert ours.get_seq_length() == 8 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    ours.reset()
    assert ours.get_seq_length() == 0 and ours._key_buffer is None


def test_a_generation_with_it_equals_one_with_dynamic_cache(tiny_model):
    """transformers' own model, greedy, 12 tokens: the same tokens and logits bit for bit (attention reads the
    buffers' views as it reads concatenated tensors)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3_moe", "bf16"))
    prompt = torch.tensor([[3, 17, 101, 250, 7]])
    runs = []
    for cache in (DynamicCache(config=model.config), engine_cache(model, prompt.shape[1] + 12)):
        with torch.inference_mode(), quiet_cache_kwarg():
            out = model.generate(
                prompt,
                max_new_tokens=12,
                do_sample=False,
                past_key_values=cache,
                output_logits=True,
                return_dict_in_generate=True,
            )
        runs.append((out.sequences, out.logits))
    (tokens, logits), (want_tokens, want_logits) = runs
    assert torch.equal(tokens, want_tokens)
    assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True))
    assert all(type(layer) is GrowingLayer for layer in engine_cache(model, 4).layers)
