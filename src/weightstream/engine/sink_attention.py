"""Attention with sinks (gpt-oss) over long contexts: prompts without the score matrix, decode without copies.

transformers' gpt-oss has no SDPA path: its eager attention repeats the keys and values for every query head and
materialises the scores of every (query, key) pair, then a copy with the sink's logit appended, its maximum
subtracted and its softmax: at a 4096-token prompt and 64 heads that is four 4 GiB matrices a layer (measured
2026-12-06: a 4096-token prompt ran 0.53x llama.cpp on gpt-oss-20b's shape). A sink is a learned logit per head in
the softmax's denominator and nowhere else, so attention with it is attention without it, scaled per row:

    out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}) = O * sigmoid(lse - sink)

where O is ordinary softmax attention and lse its row's log-sum-exp. torch's flash attention for CPU returns both
(`_scaled_dot_product_flash_attention_for_cpu`: blocks of keys, an online softmax, no T x S matrix), with the eager
mask (causal, or the sliding window's) as given.

Decode rows over a long cache pay eager's other cost: `repeat_kv` copies the keys and values for every query head
(at depth 4096, 64 heads of 8 key heads: 134 MB a layer and token, decode 97 ms a token against 38 without them on
gpt-oss-20b's 2-layer shape). Above `REPEAT_BELOW` the query heads of each key head are the rows of one product
with it instead (`_grouped`), eager's arithmetic otherwise.

Where eager's matrix is small (under `EAGER_BELOW` elements) and its copies are (under `REPEAT_BELOW`), the
module's own eager function runs, bitwise transformers'; the other two paths sum in another order, so their logits
differ from eager's within rounding (tests/test_sink_attention.py states the tolerance). Streamed and resident runs
take the same path at the same shapes and stay bitwise equal.
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import AttentionInterface

IMPLEMENTATION = "weightstream_sinks"
EAGER_BELOW = 2**24  # heads x query rows x keys: 64 MiB of float32 scores, of which eager holds four
# heads x keys x head_dim: eager's copy of the keys (and of the values) for every query head. 1 MiB of float32: on
# gpt-oss-20b's 64 heads from 64 keys (at depth 256 the grouped rows took 18.7 ms a token against eager's 19.5 on its
# 2-layer shape, 3 rounds alternated in one process); the tests' tiny model (4 heads, 512 keys, 64 wide) stays eager.
REPEAT_BELOW = 2**18


def _forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function the sink modules' configs name: eager for small matrices, flash plus the sink's
    rescaling above."""
    heads, rows, keys = query.shape[1], query.shape[2], key.shape[2]
    if heads * rows * keys < EAGER_BELOW or dropout:
        if heads * keys * query.shape[3] < REPEAT_BELOW or dropout or key.shape[1] == heads:
            return module._ws_eager(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        return _grouped(module, query, key, value, attention_mask, scaling)
    mask = _additive(attention_mask, rows, keys, query.dtype)
    out, lse = _flash_by_offset(query, key, value, mask, scaling, module.num_key_value_groups)
    kept = torch.sigmoid(lse - module.sinks.float().view(1, -1, 1))  # the softmax's mass not on the sink
    out = out * kept.unsqueeze(-1).to(out.dtype)  # a row that sees no key: lse -inf, nothing kept, as eager gives
    return out.transpose(1, 2).contiguous(), None


def _flash_by_offset(query, key, value, mask, scaling, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash attention for CPU, (output, log-sum-exp), without the keys and values repeated for every query
    head. Query head h reads key head h // groups (repeat_kv's order), so the query heads at offset g of their groups
    (g, g + groups, ...) read key heads 0, 1, ... in turn: one call per offset over the keys as they are. The
    repeated copies were a layer's keys and values times the group (537 MB a chunk at 16k positions on gpt-oss-20b's
    64 heads of 8 key heads); each row's sums are the same kernel's over the same keys in the same blocks, so the
    result is the repeated form's bitwise (tested), and faster (a 256-row chunk over 4096 keys, 2 threads: 133 against
    170 ms)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if groups == 1:
        return flash(query, key, value, 0.0, False, attn_mask=mask, scale=scaling)
    batch, heads, rows, dim = query.shape
    assert key.shape[1] * groups == heads, "query heads are not key heads x groups"
    by_offset = query.reshape(batch, heads // groups, groups, rows, dim)
    out = lse = None
    for g in range(groups):
        part, part_lse = flash(by_offset[:, :, g], key, value, 0.0, False, attn_mask=mask, scale=scaling)
        if out is None:
            out = part.new_empty(batch, heads // groups, groups, rows, part.shape[-1])
            lse = part_lse.new_empty(batch, heads // groups, groups, rows)
        out[:, :, g], lse[:, :, g] = part, part_lse
    return out.view(batch, heads, rows, -1), lse.view(batch, heads, rows)


def _grouped(module, query, key, value, mask, scaling):
    """Eager's arithmetic (scores, the sink appended, softmax, weighted values) without its copies of the keys and
    values for every query head: each key head's query heads as rows of one product. At depth 4096 on gpt-oss-20b's
    64 heads of 8 key heads those copies were 134 MB a layer and token (decode 0.47x llama.cpp). A sliding-window
    layer reads only the keys its window shows (the mask hides the others: their weights are exactly 0)."""
    batch, heads, rows, dim = query.shape
    kv, keys = key.shape[1], key.shape[2]
    mask = _additive(mask, rows, keys, query.dtype) if mask is not None else None
    window = getattr(module, "sliding_window", None)
    if window and mask is not None and keys > window + rows:  # keys the window hides: left out, not masked
        start = keys - rows - window + 1
        key, value, mask, keys = key[:, :, start:], value[:, :, start:], mask[..., start:], keys - start
    groups = heads // kv  # repeat_kv's order: query head h reads key head h // groups
    scores = torch.matmul(query.reshape(batch, kv, groups * rows, dim), key.transpose(2, 3)) * scaling
    scores = scores.view(batch, heads, rows, keys)
    if mask is not None:
        scores = scores + mask
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(batch, -1, rows, -1).to(scores.dtype)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(value.dtype)
    out = torch.matmul(probs.reshape(batch, kv, groups * rows, keys), value)
    return out.view(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def _additive(mask: torch.Tensor | None, rows: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' mask as an additive one over the keys (boolean: True attends); None: causal, the query rows the
    last `rows` positions (flash's own `is_causal` would align them with the first)."""
    if mask is None:
        mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    mask = mask[..., :keys]
    if mask.dtype is torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


AttentionInterface.register(IMPLEMENTATION, _forward)


def has_sinks(module: torch.nn.Module) -> bool:
    """Whether a module is an attention with a learned sink logit per head (transformers' gpt-oss)."""
    sinks = getattr(module, "sinks", None)
    return isinstance(sinks, torch.Tensor) and hasattr(module, "num_key_value_groups") and hasattr(module, "config")


def sinks_run_flash(model: torch.nn.Module, rows: int, keys: int) -> bool:
    """Whether every attention of `model` is a sink attention routed through `_forward` (none still eager) and a
    forward of `rows` query rows over `keys` keys takes its flash path there (`EAGER_BELOW`): what --memory's
    reserve for a late forward prices (store/facts.py `context_temporaries`)."""
    attentions = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "config")]
    if not attentions or not all(hasattr(m, "_ws_eager") for m in attentions):
        return False
    return all(m.config.num_attention_heads * rows * keys >= EAGER_BELOW for m in attentions)


def install_sink_attention(model: torch.nn.Module) -> int:
    """Route the model's sink attentions through `_forward` (eager kept for small matrices); how many modules."""
    changed = 0
    for module in model.modules():
        if not has_sinks(module) or hasattr(module, "_ws_eager"):
            continue
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None or module.config._attn_implementation != "eager":
            continue  # another implementation chosen, or a model whose eager function this cannot find: as it is
        module._ws_eager = eager
        module.config = copy.copy(module.config)
        module.config._attn_implementation_internal = IMPLEMENTATION
        changed += 1
    return changed
