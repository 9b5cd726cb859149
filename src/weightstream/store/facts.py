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

# DeepSeek's kv_b_proj as llama.cpp's converter splits it for absorbed attention, stored apart where the GGUF's blocks
# are kept (`self_attn.k_b_proj.weight`: each head's kv_lora rows of qk_nope inputs; `v_b_proj`: its v rows of kv_lora)
KV_B_HALVES = ("k_b_proj", "v_b_proj")


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


def kv_cache_bytes(text_config, context: int, dtype_bytes: float) -> int:
    """Bytes transformers' DynamicCache holds for `context` tokens of one sequence.

    Per layer and token: keys and values of every KV head (2 x kv_heads x head_dim), or for multi-head latent
    attention (DeepSeek V2/V3) the compressed latent and the rotary key (kv_lora_rank + qk_rope_head_dim), which is
    what transformers caches for them. Sliding-window layers keep at most their window. `dtype_bytes` may be a
    block type's share (q8_0: 34 / 32; a latent and rotary key are whole blocks).
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
    return int(total)


def longest_context(text_config, kv_bytes: int, dtype_bytes: float, positions: int) -> int:
    """The most positions one sequence can hold in `kv_bytes` of KV cache (`kv_cache_bytes`), at most `positions`."""
    low, high = 0, positions
    while low < high:
        mid = (low + high + 1) // 2
        if kv_cache_bytes(text_config, mid, dtype_bytes) <= kv_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def q8_0_odd_dims(text_config) -> list[str]:
    """The latent cache's rows ("kv_lora_rank N", "qk_rope_head_dim N") that are not whole 32-value q8_0 blocks."""
    sizes = {name: int(getattr(text_config, name)) for name in ("kv_lora_rank", "qk_rope_head_dim")}
    return [f"{name} {size}" for name, size in sizes.items() if size % 32]


# what a refusal of too small a budget adds where DeepSeek's latent cache is kept in float32 (--memory, tune)
def smaller_latent_kv(text_config, value_bytes: float, q8_0_runs: bool) -> str:
    """What a refusal adds for a latent cache of `value_bytes` a value (engine/kv_cache.py's storage): a float32 one
    kept in float16 (half), or q8_0 (34 bytes a 32 values) where the latent and rotary key are whole 32-value blocks
    and the native kernels that keep it run here (`q8_0_runs`); a 16-bit one in q8_0."""
    blocks = q8_0_runs and not q8_0_odd_dims(text_config)
    if value_bytes > 2:
        return ", or --kv-dtype float16: half the KV cache" + (" (q8_0: 27% of it)" if blocks else "")
    if value_bytes > 34 / 32 and blocks:
        return ", or --kv-dtype q8_0: 53% of the KV cache"
    return ""


def latent_rows_to_expand(kv_lora: int, nope: int, v: int) -> int:
    """Query rows from which DeepSeek's latent attention costs fewer multiply-adds expanded (keys and values
    re-made from the latent, then attention) than absorbed (attention over the latent itself): a head pays
    (2 kv_lora + rope) a (query, key) pair absorbed and (nope + rope + v) expanded, plus kv_lora x (nope + v) a key
    for the expansion (171 for DeepSeek-V2/V3's sizes)."""
    saved_a_pair = 2 * kv_lora - nope - v
    return -(-kv_lora * (nope + v) // saved_a_pair) if saved_a_pair > 0 else 0


def context_temporaries(
    text_config,
    context: int,
    chunk: int,
    dtype_bytes: float,
    eager: bool,
    latent: str = "absorbed",
    flash_below: int = 0,
) -> int:
    """Bytes a forward of `chunk` positions after `context` cached ones holds that a first forward of `chunk`
    positions (--memory's warm-up) does not, since they grow with the context: a layer's keys and values copied
    while it appends (DynamicCache concatenates: the old and the new tensor live together), or, where query heads
    share KV heads, the layer's keys and values repeated for every query head (transformers' sdpa repeats them for a
    masked forward, every chunk after the first; eager attention always), whichever is more (the copy is freed
    before attention runs); and eager attention's scores, heads x chunk x context, in float32 for the softmax and
    twice in the model's dtype. DeepSeek's latent attention (`latent` its form, engine/latent_attention.py) holds
    instead the cache widened to float32 (the torch paths read any stored dtype so), and: absorbed, a group of heads'
    float32 scores over the context three times (scores, masked, softmax; `latent_group`) and a decode row's partial
    sums (a block of 128 positions, kv_lora floats a head), or, for a chunk of `latent_rows_to_expand` rows or more,
    a group of heads' keys and values re-made for the whole context and attended, with kv_b's weight in float32 (the
    larger of the two, as a prompt's last, short chunk takes the first), each under transformers' mask; the expanded
    form: every head's keys and values re-made for the whole context.

    `flash_below`: attention with sinks (gpt-oss) runs as flash attention from that many score elements (heads x rows
    x keys; engine/sink_attention.py `EAGER_BELOW`; `eager` then False): a chunk of that size holds no score matrix
    and no keys repeated for the query heads, only the layer's keys and values once and its mask (chunk x context in
    the compute dtype, and a boolean form of it: counted as 3 bytes a position); the forwards under it late in the
    context (a prompt's last, short chunk; decode rows; sliding-window layers) run eager's arithmetic, whose scores
    and softmax are counted at that chunk's size up to `flash_below` elements."""
    if getattr(text_config, "kv_lora_rank", None):
        widened = _kv_elements_per_token(text_config) * max(4, dtype_bytes) * context
        return int(widened + _latent_temporaries(text_config, context, chunk, dtype_bytes, eager, latent))
    layer = int(_kv_elements_per_token(text_config) * dtype_bytes * context)
    heads = int(text_config.num_attention_heads)
    groups = heads // int(getattr(text_config, "num_key_value_heads", None) or heads)
    total = layer if flash_below else max(layer, groups * layer)
    if eager:
        total += heads * chunk * context * (4 + 2 * dtype_bytes)
    if flash_below:
        total += chunk * context * (dtype_bytes + 3) + min(heads * chunk * context, flash_below) * (4 + 2 * dtype_bytes)
    return int(total)


GROUP_BYTES = 64 * 2**20  # what one group of heads of a prompt chunk's latent attention may hold


def latent_group(heads: int, per_head: float) -> tuple[int, float]:
    """(heads, bytes): as many heads as fit in GROUP_BYTES at `per_head` bytes each, one at least, and what they
    hold. A prompt chunk's latent attention by torch (engine/latent_attention.py) runs a group at a time: all heads
    at once held 1.07 GiB more at depth 16384 on V2-Lite's 16 heads (a 256-row chunk, expanded; 2026-12-07), where
    `--memory` had reserved 613 MiB; a head at a time, 184 MiB."""
    group = max(1, min(heads, int(GROUP_BYTES // max(1, per_head))))
    return group, group * per_head


def absorb_group(heads: int, context: int, rows: int) -> tuple[int, float]:
    """`latent_group` for absorbed attention by torch (a chunk of 2 to `latent_rows_to_expand` - 1 rows): per head,
    its float32 scores over the context, masked, and their softmax."""
    return latent_group(heads, 3 * rows * context * 4)


def expand_group(heads: int, context: int, rows: int, nope: int, rope: int, v: int, dtype_bytes: float):
    """`latent_group` for the expanded chunk (`latent_rows_to_expand` rows or more): per head, kv_b's output for the
    context (nope + v values a position), its keys with the rotary key (nope + rope), its values made contiguous (v),
    and its scores, masked scores and softmax in float32 (torch's attention with a mask, on CPU)."""
    return latent_group(heads, context * (2 * nope + rope + 2 * v) * dtype_bytes + 3 * rows * context * 4)


def _latent_temporaries(cfg, context: int, chunk: int, dtype_bytes: float, eager: bool, latent: str) -> float:
    heads, lora = int(cfg.num_attention_heads), int(cfg.kv_lora_rank)
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    crossover = latent_rows_to_expand(lora, nope, v)
    if latent == "absorbed":  # under transformers' mask (float, bool); a decode row's partial sums
        absorbed = absorb_group(heads, context, min(chunk, max(1, crossover - 1)))[1]
        absorbed += -(-context // 128) * heads * lora * 4
        if chunk >= crossover:  # kv_b's weight in float32: its halves decoded, then joined
            kv_b = 2 * heads * (nope + v) * lora * 4
            absorbed = max(absorbed, expand_group(heads, context, chunk, nope, rope, v, dtype_bytes)[1] + kv_b)
        return absorbed + chunk * context * 5
    expanded = heads * context * (2 * nope + rope + 2 * v) * dtype_bytes  # kv_b's output, then keys, values
    return expanded + (heads * chunk * context * (4 + 2 * dtype_bytes) if eager else 0)


def _kv_elements_per_token(cfg) -> int:
    if getattr(cfg, "kv_lora_rank", None):
        return int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * int(heads) * int(head_dim)
