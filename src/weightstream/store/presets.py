"""Model shapes for synthetic checkpoints: tiny ones per architecture for tests, real ones for benchmarks."""

from __future__ import annotations

from weightstream.errors import WeightstreamError

_TINY_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_TINY_MLA = dict(
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    intermediate_size=96,
    n_shared_experts=1,
    num_key_value_heads=4,
)

# Tiny configs of every architecture the test suite proves token-exact; extra layers keep real structure
# (dense first layers, shared experts) visible.
TINY = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=96,
        num_key_value_heads=2,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        intermediate_size=96,
        num_key_value_heads=2,
    ),
    "mixtral": dict(
        model_type="mixtral",
        num_hidden_layers=3,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_key_value_heads=2,
    ),
    "olmoe": dict(
        model_type="olmoe",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_key_value_heads=4,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_hidden_layers=3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        **_TINY_MLA,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        num_hidden_layers=3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        **_TINY_MLA,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe",
        num_hidden_layers=3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=96,
        num_key_value_heads=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        use_qk_norm=True,  # GLM-4.5 has attention biases but no q/k norms; the tiny one has both, proving both
        attention_bias=True,
        num_nextn_predict_layers=0,  # transformers' Glm4Moe does not build the MTP layer
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=3,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        num_key_value_heads=2,
        max_position_embeddings=131072,
    ),
}

# Real models' shapes, copied from each model's published config.json (bf16); `--layers` shrinks them.
# Also the named shapes of routing traces (`trace.shapes.resolve_shape`).
REAL = {
    "olmoe-1b-7b": dict(
        model_type="olmoe",
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=50304,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_experts=128,
        num_experts_per_tok=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=102400,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}
# DeepSeek-V3's architecture (sigmoid routing with its correction bias, a q_lora projection) at V2-Lite's attention
# and expert sizes: the shape DeepSeek-V3/R1 and Kimi-K2 decode with, small enough for these machines. Its q_lora
# (V3's 1536) lets llama.cpp's quantizer take it at any layer count (it recognises a plain-q deepseek2 file by
# V2-Lite's 27 layers alone).
REAL["deepseek-v3-lite"] = REAL["deepseek-v2-lite"] | dict(
    model_type="deepseek_v3", q_lora_rank=1536, norm_topk_prob=True, routed_scaling_factor=2.5
)

REAL |= {
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "glm-4.5-air": dict(
        model_type="glm4_moe",
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        first_k_dense_replace=1,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=False,
        vocab_size=151552,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=0,  # its one MTP layer (speculation) is not built by transformers' Glm4Moe
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=201088,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}

PRESETS = ("tiny", *REAL)


def preset_config(preset: str, arch: str = "qwen3_moe", layers: int | None = None) -> dict:
    """Config fields for a preset (`tiny` takes an architecture); `layers` overrides the layer count."""
    if preset == "tiny":
        if arch not in TINY:
            raise WeightstreamError(f"--arch {arch!r}: no tiny config; choose one of {', '.join(TINY)}")
        fields = {**_TINY_COMMON, **TINY[arch]}  # MLA configs override head_dim with their rope dim
    elif preset in REAL:
        fields = dict(REAL[preset])
    else:
        raise WeightstreamError(f"--preset {preset!r}: unknown; choose one of {', '.join(PRESETS)}")
    if layers is not None:
        if layers < 1:
            raise WeightstreamError(f"--layers {layers}: need at least 1 layer")
        fields["num_hidden_layers"] = layers
        if fields.get("first_k_dense_replace", 0) >= layers:
            fields["first_k_dense_replace"] = 0  # keep at least one MoE layer
    return fields
