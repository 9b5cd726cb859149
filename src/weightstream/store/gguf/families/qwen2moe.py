"""`qwen2moe` (Qwen1.5/Qwen2 MoE) -> transformers' qwen2_moe: a shared expert beside the routed ones, with its own
sigmoid gate (a dense weight); no renormalization of the top-k weights."""

from __future__ import annotations

from weightstream.store.gguf.families.base import Family
from weightstream.store.gguf.families.qwen3moe import dense_layers


class Qwen2Moe(Family):
    arch = "qwen2moe"
    model_type = "qwen2_moe"
    norm_topk = False

    def config(self, gf, key, fields):
        fields["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", why="shared expert width")
        dense_layers(gf, key, fields)


FAMILY = Qwen2Moe()
