"""`glm4moe` (GLM-4.5, GLM-4.6, GLM-4.5-Air) -> transformers' glm4_moe: partial rotary (`rope.dimension_count` of
`attention.key_length` -> partial_rotary_factor; llama.cpp runs it NeoX-style, as transformers does, and the
converter permutes nothing), attention biases and q/k norms where the file has them, shared experts
(`expert_shared_count`), sigmoid routing with its `exp_probs_b` biases (the router's e_score_correction_bias, kept
float32) and groups, leading dense layers. llama.cpp's converter appends the next-token-prediction (MTP) layer(s)
after the model's own (`block_count` counts them, `nextn_predict_layers` says how many): transformers' Glm4Moe does
not run them, so they are skipped and the import says so."""

from __future__ import annotations

from weightstream.errors import WeightstreamError
from weightstream.store.gguf.families.base import Family, decimal
from weightstream.store.gguf.families.deepseek2 import Deepseek2


class Glm4Moe(Family):
    arch = "glm4moe"
    label = "glm4moe (GLM-4.5/4.6)"
    model_type = "glm4_moe"
    experts_field = "n_routed_experts"
    norm_topk = False  # llama.cpp's default when the key is absent
    float32_keys = Deepseek2.float32_keys
    renames = Deepseek2.renames

    def config(self, gf, key, fields):
        head_dim, rope = fields["head_dim"], key("rope.dimension_count", fields["head_dim"])
        if rope > head_dim or rope % 2:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.rope.dimension_count is {rope} for heads of {head_dim}; the rotary part must "
                "be an even number of a head's dims: the file is damaged"
            )
        gating = key("expert_gating_func", 2)
        if gating != 2:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.expert_gating_func is {gating}; transformers' Glm4Moe scores experts by "
                "sigmoid (2) only: this scoring function is not supported"
            )
        leading = key("leading_dense_block_count", 0)
        fields |= {
            "partial_rotary_factor": rope / head_dim,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in gf.tensors,
            "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
            "n_shared_experts": key("expert_shared_count", why="shared experts per layer"),
            "first_k_dense_replace": leading,
            "n_group": key("expert_group_count", 1),
            "topk_group": key("expert_group_used_count", 1),
            "routed_scaling_factor": decimal(key("expert_weights_scale", 0.0)) or 1.0,
            "num_nextn_predict_layers": 0,  # skipped: the model runs without them
        }
        if leading:
            fields["intermediate_size"] = key("feed_forward_length", why="width of the leading dense layers")


FAMILY = Glm4Moe()
