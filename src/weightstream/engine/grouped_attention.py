"""Grouped-query attention over a long cache without torch's grouped path: each key head's query heads as the rows of
one attention with it.

transformers runs a grouped-query model's attention (Qwen3-MoE, GLM-4.5, Mixtral, Qwen2-MoE: fewer key heads than
query heads) through `scaled_dot_product_attention`: with `enable_gqa=True` where no mask is given (a decode row),
else with the keys and values repeated for every query head (`repeat_kv`, a prompt at depth). On the CPU both cost
more than the attention: measured 2026-12-06 on Qwen3-30B-A3B's heads (32 query heads of 4 key heads, 128 dims),
2 threads, one decode row at depth 4096: 6.6 ms a layer through `enable_gqa`, 3.3 ms as 4 key heads each with its 8
query heads as rows (16384 positions: 38.9 against 12.1 ms); the 2-layer model decoded at 0.78x llama.cpp's speed
there. `_forward` runs the second form: the query (B, H, S, D) viewed as (B, H_kv, G x S, D), one attention per key
head, the mask's rows repeated G times where there is a mask (a prompt at depth), nothing copied of the cache.

It sums in another order than torch's grouped path, so where it runs the logits differ within float32 rounding
(tests/test_grouped_attention.py states the tolerance). Below `GROUPED_FROM` (query heads x keys x head dim: what
`repeat_kv` would copy of the keys) transformers' own function runs, bitwise its logits; a causal prompt with no mask
(the first forward) does too. Streamed and resident runs take the same path at the same shapes and stay bitwise
equal.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

IMPLEMENTATION = "weightstream_grouped"
GROUPED_FROM = 2**20  # query heads x keys x head dim: 32 heads of 128 dims at 256 positions


def _forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention function signature; (B, S, H, D_v) outputs."""
    batch, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    if not _groups_apply(query, key, value, attention_mask, groups, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, key.shape[1], groups * rows, dim)  # (B, H_kv, G*S, D): head h is key head h // G
    mask = attention_mask
    if mask is not None and rows > 1:  # the mask's rows again for every query head of a key head
        mask = mask.unsqueeze(2).expand(batch, 1, groups, rows, mask.shape[-1]).reshape(batch, 1, groups * rows, -1)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


def _groups_apply(query, key, value, mask, groups: int, kwargs) -> bool:
    """Whether `_forward`'s grouped form runs: several query heads a key head, a long cache, a mask shared by the
    heads (or one decode row without one), nothing transformers' function does besides attention."""
    if groups < 2 or query.shape[1] != groups * key.shape[1] or key.shape[-1] != value.shape[-1]:
        return False
    if query.shape[1] * key.shape[2] * key.shape[3] < GROUPED_FROM:
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks")):
        return False
    if kwargs.get("output_attentions"):
        return False
    if mask is None:
        return query.shape[2] == 1  # a prompt without a mask is causal: transformers' function knows how
    return mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == query.shape[2]


AttentionInterface.register(IMPLEMENTATION, _forward)


def install_grouped_attention(model: torch.nn.Module) -> int:
    """Route the model's grouped-query SDPA attentions through `_forward`; how many modules."""
    changed = 0
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", 1)
        config = getattr(module, "config", None)
        if not isinstance(groups, int) or groups < 2 or config is None or not hasattr(module, "is_causal"):
            continue
        if getattr(config, "_attn_implementation", None) != "sdpa":
            continue  # eager (gpt-oss's sinks), DeepSeek's latent attention, or another choice: as it is
        module.config = copy.copy(config)
        module.config._attn_implementation_internal = IMPLEMENTATION
        changed += 1
    return changed
