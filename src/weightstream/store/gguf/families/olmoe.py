"""`olmoe` (OLMoE) -> transformers' olmoe: one expert width (`intermediate_size`), q/k norms over the whole
projection, an optional clamp of q/k/v (`attention.clamp_kqv`)."""

from __future__ import annotations

from weightstream.store.gguf.families.base import Family, decimal


class Olmoe(Family):
    arch = "olmoe"
    model_type = "olmoe"
    width_field = "intermediate_size"
    norm_topk = False

    def config(self, gf, key, fields):
        if key("attention.clamp_kqv", None, kind=float) is not None:
            fields["clip_qkv"] = decimal(key("attention.clamp_kqv", kind=float))


FAMILY = Olmoe()
