"""The engine's KV cache (engine/kv_cache.py) against transformers' DynamicCache: same keys and values, same
generations, in place of concatenation; and a model that builds a cache of its own (MiniMax) streams with it."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from weightstream.engine.generate import generate
from weightstream.engine.kv_cache import GrowingLayer, engine_cache, quiet_cache_kwarg, takes_dynamic_cache
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.service import ModelService, ServeSettings
from weightstream.store.synth import DTYPES, synthesize


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


# Every MoE architecture of the installed transformers whose experts go through `@use_experts_implementation` and
# whose model builds a cache of its own (transformers' `_supports_default_dynamic_cache()` is False): a tiny config
# of each, with both kinds of layer.
OWN_CACHE = {
    "minimax": dict(
        model_type="minimax",
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        block_size=4,  # the 8-position prompt spans linear attention's blocks
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_key_value_heads=2,
    ),
}
_TINY = dict(
    hidden_size=64, num_attention_heads=4, head_dim=16, vocab_size=512, max_position_embeddings=512,
    tie_word_embeddings=False,
)  # fmt: skip


def _own_cache_architectures() -> set[str]:
    import importlib
    import inspect
    import pathlib

    import transformers

    found = set()
    for path in sorted(pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        if "@use_experts_implementation" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and name.endswith("ForCausalLM") and not cls._supports_default_dynamic_cache():
                found.add(path.parent.name)
    return found


def test_every_moe_architecture_with_a_cache_of_its_own_is_checked():
    """A transformers that adds one fails here until OWN_CACHE has its tiny config."""
    assert _own_cache_architectures() == set(OWN_CACHE)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", sorted(OWN_CACHE))
def test_a_model_with_a_cache_of_its_own_streams_token_exact(tmp_path, arch, dtype):
    """The engine hands such a model no cache (it raises on a DynamicCache): `generate` streams it with its own and
    gets the in-memory model's greedy tokens; serve, which holds every sequence in a DynamicCache, refuses it at
    load in one line."""
    model_dir = str(tmp_path / arch)
    synthesize(model_dir, {**_TINY, **OWN_CACHE[arch]}, dtype=dtype, seed=1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], experts_implementation="eager")
    assert not takes_dynamic_cache(ref) and engine_cache(ref, 8) is None
    prompt = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
    with torch.inference_mode():
        want = ref.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert len(want) == 12
    for size in ("1x", "100x"):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=2)
        try:
            new, stats = generate(model, prompt, 12)
        finally:
            model.weightstream.close()
        assert new[0].tolist() == want, (arch, dtype, size)
        assert stats.expert_misses > 0
    service = ModelService(ServeSettings(model_dir), ServeMetrics())
    with pytest.raises(WeightstreamError, match="keeps a cache of its own"):
        service.load()


def test_a_model_that_takes_a_dynamic_cache_still_gets_the_engines(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3_moe"))
    assert takes_dynamic_cache(model) and isinstance(engine_cache(model, 8), DynamicCache)
