"""Grouped-query attention over a long cache (engine/grouped_attention.py): within float32 rounding of transformers'
SDPA where it runs, transformers' own bits where it does not, streamed equal to resident either way."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from weightstream.engine import grouped_attention
from weightstream.engine.grouped_attention import GROUPED_FROM, IMPLEMENTATION, _forward, _groups_apply
from weightstream.engine.loader import load_streaming_model

from engine_support import greedy_run

TOLERANCE = 1e-5  # relative to the largest output; measured 1.2e-6 for a row without a mask, 0 with one
PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])


class _Attention(torch.nn.Module):
    """What the attention functions read of the module: grouped query heads, causal."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(heads: int, kv_heads: int, rows: int, keys: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key, value = torch.randn(2, 1, kv_heads, keys + 64, dim, generator=gen)[:, :, :, :keys]  # views, as the cache
    return query, key, value


def _causal_at_depth(rows: int, keys: int, hidden: int = 0) -> torch.Tensor:
    """transformers' boolean SDPA mask (True: attend) for `rows` queries at the end of `keys` positions, the first
    `hidden` positions masked (a padded sequence)."""
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    mask[:, :hidden] = False
    return mask[None, None]


@pytest.mark.parametrize(
    "rows,mask_kind", [(1, "none"), (1, "padded"), (5, "causal"), (5, "padded")], ids=lambda x: str(x)
)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 4, 128), (12, 2, 64)])
def test_grouped_form_is_sdpa_within_rounding(rows, mask_kind, heads, kv_heads, dim):
    keys = GROUPED_FROM // (heads * dim) + 37
    query, key, value = _inputs(heads, kv_heads, rows, keys, dim, seed=rows + heads)
    mask = None if mask_kind == "none" else _causal_at_depth(rows, keys, 9 if mask_kind == "padded" else 0)
    module = _Attention(heads // kv_heads)
    assert _groups_apply(query, key, value, mask, heads // kv_heads, {})
    got, _ = _forward(module, query, key, value, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, rows, heads, dim)
    assert float((got - want).abs().max() / want.abs().max()) <= TOLERANCE


def test_short_caches_and_unmasked_prompts_run_transformers_function_bitwise():
    module = _Attention(4)
    short = _inputs(32, 8, 1, GROUPED_FROM // (32 * 64) - 1, 64, seed=1)
    assert not _groups_apply(*short, None, 4, {})
    prompt = _inputs(32, 8, 6, GROUPED_FROM // (32 * 64) + 1, 64, seed=2)
    assert not _groups_apply(*prompt, None, 4, {})  # causal without a mask: transformers' own handling
    assert not _groups_apply(*prompt, _causal_at_depth(6, prompt[1].shape[2]), 4, {"softcap": 30.0})
    for query, key, value in (short, prompt):
        got, _ = _forward(module, query, key, value, None, scaling=0.125)
        want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.125)
        assert torch.equal(got, want)


def test_installed_on_grouped_sdpa_attention_only(tiny_model):
    """qwen3_moe's tiny shape has 4 query heads of 2 key heads; olmoe's one key head a query head; gpt-oss runs
    eager (its sinks), DeepSeek its latent attention."""
    for arch, grouped in (("qwen3_moe", True), ("olmoe", False), ("gpt_oss", False), ("deepseek_v3", False)):
        model = load_streaming_model(tiny_model(arch), expert_cache="1x")
        try:
            names = {m.config._attn_implementation for m in model.modules() if hasattr(m, "num_key_value_groups")}
        finally:
            model.weightstream.close()
        assert (IMPLEMENTATION in names) == grouped, (arch, names)


def test_a_grouped_model_through_the_grouped_form(tiny_model, monkeypatch):
    """With the threshold at 0 every decode row of the tiny grouped model runs the grouped form: logits within
    TOLERANCE of transformers', streamed equal to resident bitwise at every cache size and thread count."""
    monkeypatch.setattr(grouped_attention, "GROUPED_FROM", 0)
    calls = []
    applies = grouped_attention._groups_apply
    monkeypatch.setattr(grouped_attention, "_groups_apply", lambda *a: calls.append(applies(*a)) or calls[-1])
    model_dir = tiny_model("qwen3_moe")
    tokens, logits, _ = greedy_run(model_dir, PROMPT, 10, expert_cache="100x")
    assert calls.count(True) >= 9  # every decode row of every layer (the unmasked prompt: transformers')
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.inference_mode():
        out = ref.generate(PROMPT, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert tokens == out.sequences[0].tolist()
    for got, want in zip(logits, out.logits, strict=True):
        assert float((got - want).abs().max() / want.abs().max()) <= TOLERANCE
    for size, threads in (("1x", 1), ("1.5x", 8)):
        streamed_tokens, streamed, runtime = greedy_run(model_dir, PROMPT, 10, expert_cache=size, io_threads=threads)
        assert runtime.cache.stats.misses > 0
        assert streamed_tokens == tokens and all(torch.equal(s, w) for s, w in zip(streamed, logits, strict=True))
