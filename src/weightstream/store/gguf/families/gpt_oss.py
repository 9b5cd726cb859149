"""`gpt-oss` (gpt-oss-20b, gpt-oss-120b) -> transformers' gpt_oss.

Experts: llama.cpp's converter splits gpt-oss's fused `gate_up_proj`, whose columns alternate gate and up (the
model's `_apply_gate` takes `[..., ::2]` and `[..., 1::2]`), into `ffn_gate_exps` and `ffn_up_exps`, each row one
output of its projection; the import interleaves them back, row by row (gate_0, up_0, gate_1, up_1, ...: whole rows
of blocks, so an MXFP4, Q4_K or Q8_0 expert keeps the file's bytes), and the biases `ffn_gate_exps.bias` and
`ffn_up_exps.bias` the same way into `gate_up_proj_bias`; `ffn_down_exps.bias` is `down_proj_bias`. The biases go
into the expert's blob after their projection in the activation dtype, as `weightstream quantize` lays out a
gpt-oss expert (store/quant/pipeline.py), and the engine adds them after each native product, around the module's own
clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7.0: llama.cpp's LLM_FFN_SWIGLU_OAI_MOE has them as constants
and the file no key for them, so the config keeps transformers' defaults, the same values).

The rest, as llama.cpp's `llama_model_openai_moe` runs it: the router `ffn_gate_inp` with its bias (softmax over
the top-k logits, no renormalization key: llama.cpp ignores `expert_weights_norm`/`expert_weights_scale` here and so
does the import); q/k/v/o biases (`attention_bias`); attention sinks (`blk.N.attn_sinks.weight` -> self_attn.sinks,
one per head); `post_attention_norm` -> post_attention_layernorm; NeoX-style rope over the whole head (as
transformers' gpt_oss rotates halves; nothing permuted; a `rope.dimension_count` short of the head is refused);
sliding windows of `attention.sliding_window` on every other layer: llama.cpp's SWA pattern for gpt-oss is 2 with
the even layers sliding (layer 0 sliding, 1 full, ...), transformers' default `layer_types`; a file's own
`attention.sliding_window_pattern` (a period, or one flag per layer) is read as llama.cpp reads it. A separate
`rope.freq_base_swa` different from `rope.freq_base` is refused (transformers' GptOss has one rope).

YaRN: `rope.scaling.type` yarn, `.factor`, `.original_context_length`, `.yarn_beta_fast`/`.yarn_beta_slow`.
gpt-oss files carry no `yarn_log_multiplier`; llama.cpp then scales attention by YaRN's default 0.1 ln(factor) + 1
(its loader's get_mscale(factor, 1), divided out and multiplied back by ggml's rope), which is transformers' yarn
default when neither mscale nor attention_factor is set: the config sets neither. A file with
`yarn_log_multiplier`, `yarn_ext_factor`, `yarn_attn_factor` or `attn_factor` is refused (the converter writes none
for gpt-oss). The correction range: ggml's `ggml_rope_yarn_corr_dims` always floors the low dim and ceils the
high one (transformers' `truncate` True); gpt-oss's published config and transformers' GptOss default say
`truncate: False`, the range as OpenAI's reference implementation computes it (vLLM #28244 and SGLang #14270 moved
to it for gpt-oss after logprob errors against the trained model). The import writes `truncate: False`: the GGUF
holds gpt-oss's weights, the model is defined (and was trained) with the exact range, and llama.cpp's rounding is
its generic YaRN code, not something the file says. On gpt-oss's rope (head 64, theta 150000, factor 32, original
4096, betas 32/1) the range is 8.09-17.40 exact, 8-18 truncated: 9 of the 32 frequencies differ, by up to 76%, so
the imported model's logits differ from llama.cpp's (the tests compare with transformers' own model of the source).
"""

from __future__ import annotations

from weightstream.errors import WeightstreamError
from weightstream.store.gguf.families.base import Family, decimal


class GptOss(Family):
    arch = "gpt-oss"
    label = "gpt-oss"
    model_type = "gpt_oss"
    experts_field = "num_local_experts"
    width_field = "intermediate_size"
    gate_up_interleaved = True
    renames = (("self_attn.sinks", "self_attn.sinks.weight"),)  # llama.cpp: `blk.N.attn_sinks.weight`

    def rope_parameters(self, gf, key):
        scaling = key("rope.scaling.type", "none")
        theta = decimal(key("rope.freq_base", 10000.0))  # llama.cpp's default when a file has none
        where = f"{gf.path}: rope scaling {scaling!r} ({self.arch}.rope.scaling.type)"
        if scaling in ("none", None):
            return {"rope_type": "default", "rope_theta": theta}
        if scaling != "yarn":
            raise WeightstreamError(
                f"{where}; transformers' GptOss takes yarn (as gpt-oss is published) or none from a GGUF file: this "
                "scaling is not supported"
            )
        for name in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor", "attn_factor"):
            if key(f"rope.scaling.{name}", None, kind=float) is not None:
                raise WeightstreamError(
                    f"{where} with {self.arch}.rope.scaling.{name} = {key(f'rope.scaling.{name}', kind=float)}: "
                    "gpt-oss scales "
                    "YaRN attention by 0.1 ln(factor) + 1 alone, and llama.cpp's converter writes no such key for "
                    "it; not supported"
                )
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": decimal(key("rope.scaling.factor", why="YaRN's context extension factor", kind=float)),
            "original_max_position_embeddings": key(
                "rope.scaling.original_context_length", why="YaRN's original context length"
            ),
            "beta_fast": decimal(key("rope.scaling.yarn_beta_fast", 32.0)),  # llama.cpp's defaults, gpt-oss's values
            "beta_slow": decimal(key("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,  # gpt-oss's own correction range (the module docstring says why)
        }

    def config(self, gf, key, fields):
        head_dim, layers = fields["head_dim"], fields["num_hidden_layers"]
        rope = key("rope.dimension_count", head_dim)
        if rope != head_dim:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.rope.dimension_count is {rope} for heads of {head_dim}; transformers' "
                "GptOss rotates the whole head: not supported"
            )
        swa_base = key("rope.freq_base_swa", None, kind=float)
        if swa_base is not None and decimal(swa_base) != fields["rope_parameters"]["rope_theta"]:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.rope.freq_base_swa is {decimal(swa_base)}, rope.freq_base "
                f"{fields['rope_parameters']['rope_theta']}; transformers' GptOss has one rope for every layer: not "
                "supported"
            )
        # llama.cpp: a period (default 2), or a flag per layer
        pattern = key("attention.sliding_window_pattern", 2, kind=(int, list))
        if isinstance(pattern, list):
            if len(pattern) < layers:
                raise WeightstreamError(
                    f"{gf.path}: {self.arch}.attention.sliding_window_pattern has {len(pattern)} flags for {layers} "
                    "layers; the file is damaged"
                )
            sliding = [bool(p) for p in pattern[:layers]]
        else:
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        fields |= {
            "sliding_window": key("attention.sliding_window", why="the sliding attention window"),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
            "swiglu_alpha": 1.702,  # llama.cpp's constants for LLM_FFN_SWIGLU_OAI_MOE (no key in the file)
            "swiglu_limit": 7.0,
        }


FAMILY = GptOss()
