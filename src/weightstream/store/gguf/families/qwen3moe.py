"""`qwen3moe` (Qwen3 MoE) -> transformers' qwen3_moe. llama.cpp renormalizes the top-k routing weights unless the
file says otherwise; q/k rows as transformers has them (NeoX-style rope); a layer without experts is a dense MLP
layer (`mlp_only_layers`)."""

from __future__ import annotations

from weightstream.store.gguf.families.base import Family, Key


def dense_layers(gf, key: Key, fields: dict) -> None:
    """Qwen MoE layers without routed experts are dense MLP layers of `feed_forward_length`."""
    dense = [i for i in range(fields["num_hidden_layers"]) if f"blk.{i}.ffn_gate_exps.weight" not in gf.tensors]
    if dense:
        fields["mlp_only_layers"] = dense
        fields["intermediate_size"] = key("feed_forward_length", why="width of the dense layers")


class Qwen3Moe(Family):
    arch = "qwen3moe"
    model_type = "qwen3_moe"
    norm_topk = True

    def config(self, gf, key, fields):
        dense_layers(gf, key, fields)


FAMILY = Qwen3Moe()
