"""What a model's config says that several layers need: its experts per token, whether its output head is its input
embedding, which dense weights decode hardly touches, and the bytes of its KV cache for a context.

The engine (what it loads and counts), the budget and the page-cache model of `tune` (sim), quantize and routing
traces' shapes all take these facts from here, so that each is decided once. Imports nothing heavy: a transformers
config or config.json's fields as a dict will do.
"""

from __future__ import annotations

# the config fields that name a MoE model's experts per token, in the order they are looked for
TOP_K_FIELDS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "experts_per_token",
    "moe_topk",
    "top_k",
    "moe_top_k",
)


def top_k(config) -> int | None:
    """Experts per token: the first of TOP_K_FIELDS that is a positive integer, in a transformers config
    (attributes) or config.json's fields (a dict); None where none is."""
    for name in TOP_K_FIELDS:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def ties_embeddings(config) -> bool:
    """Whether a transformers config ties the output head to the input embedding (so every step reads all of it)."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def is_lazy_dense(name: str, tied: bool) -> bool:
    """Whether dense parameter `name` is one that decode hardly touches: an untied input embedding, read one row per
    token (`sim.budget.lazy_dense_bytes`)."""
    return not tied and name.endswith("embed_tokens.weight")


def kv_cache_bytes(text_config, context: int, dtype_bytes: int) -> int:
    """Bytes transformers' DynamicCache holds for `context` tokens of one sequence.

    Per layer and token: keys and values of every KV head (2 x kv_heads x head_dim), or for multi-head latent
    attention (DeepSeek V2/V3) the compressed latent and the rotary key (kv_lora_rank + qk_rope_head_dim), which is
    what transformers caches for them. Sliding-window layers keep at most their window.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    per_token = _kv_elements_per_token(text_config) * dtype_bytes
    total = 0
    for kind, kwargs in zip(layer_types, layer_kwargs):
        if kind == "dummy":
            continue
        window = kwargs.get("sliding_window")
        total += per_token * (min(context, window) if window else context)
    return total


def _kv_elements_per_token(cfg) -> int:
    if getattr(cfg, "kv_lora_rank", None):
        return int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * int(heads) * int(head_dim)
