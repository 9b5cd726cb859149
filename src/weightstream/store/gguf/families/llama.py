"""`llama` with `llama.expert_count` > 0 (Mixtral) -> transformers' mixtral. llama.cpp's converter reorders the rows
of `attn_q` and `attn_k` of LLaMA-style models for its rope: within each head, row (half, i) is stored at (i, half);
the import puts them back (whole rows move, so rows of blocks move as they are). A dense llama file is refused."""

from __future__ import annotations

import re

from weightstream.store.gguf.families.base import Family


class Llama(Family):
    arch = "llama"
    label = "llama with experts (Mixtral)"
    model_type = "mixtral"
    experts_field = "num_local_experts"
    width_field = "intermediate_size"

    def refuse(self, gf, key):
        return None if key("expert_count", 0) else "a dense llama model (no experts)"

    def permute_heads(self, key, config):
        if re.search(r"\.self_attn\.[qk]_proj\.weight$", key):
            return config.num_attention_heads if ".q_proj." in key else config.num_key_value_heads
        return None


FAMILY = Llama()
