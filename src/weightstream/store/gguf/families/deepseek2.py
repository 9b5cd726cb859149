"""`deepseek2` (DeepSeek-V2, V2-Lite, V3, R1, Kimi-K2) -> transformers' deepseek_v2 or deepseek_v3, chosen by how
the file says experts are scored: softmax (`expert_gating_func` 1, or absent without routing biases, as llama.cpp
reads older V2 files) is DeepseekV2; sigmoid (2), or routing biases (`exp_probs_b`) with no gating key, is
DeepseekV3, its biases the router's `e_score_correction_bias`. The router and its biases are stored float32,
as the file holds them and transformers computes them.

Multi-head latent attention as llama.cpp stores it: `attn_q` (no `attention.q_lora_rank`) or `attn_q_a`,
`attn_q_a_norm`, `attn_q_b`; `attn_kv_a_mqa`, `attn_kv_a_norm`; and `attn_kv_b` whole (older files) or split into
`attn_k_b` (per head, transposed: kv_lora_rank x qk_nope_head_dim) and `attn_v_b` (v_head_dim x kv_lora_rank), as
the current converter writes them for its absorbed attention. Where both halves are blocks the native kernels run
(`llama-quantize` makes k_b Q5_0/Q8_0 and v_b Q4_K and the like), they are stored as they are, under the keys
`self_attn.k_b_proj.weight` and `self_attn.v_b_proj.weight` (`KV_B_HALVES`), and the absorbed attention multiplies
by them in the file's own types, as llama.cpp does (engine/latent_attention.py); float halves (and a checkpoint
without a table of blocks) are joined back into transformers' `kv_b_proj`, shapes checked.
Head sizes come from `attention.key_length_mla`/`value_length_mla` where the file has them (the current converter
writes `key_length` = kv_lora_rank + rope dims for its MQA form), else `key_length`/`value_length` (older files).
llama.cpp writes `head_count_kv` 1 for that MQA form; transformers expands kv_b per head, so every head has its
own key and value. Rope rows are as transformers takes them: llama.cpp runs DeepSeek's interleaved rope as its
"normal" rope and the converter permutes nothing.

Routing: `expert_group_count`/`expert_group_used_count` -> n_group/topk_group (V2 with groups: group-limited
greedy), `expert_weights_scale` -> routed_scaling_factor (0 or absent: 1, as llama.cpp runs it),
`expert_weights_norm` -> norm_topk_prob (V2 never renormalizes: a softmax file that says it does is refused).
Shared experts (`ffn_*_shexp`, `expert_shared_count`) and leading dense layers (`leading_dense_block_count` ->
first_k_dense_replace, of `feed_forward_length`). YaRN (`rope.scaling.type` yarn): factor, original context,
beta_fast/beta_slow; `rope.scaling.yarn_log_multiplier` is 0.1 x mscale_all_dim as llama.cpp's converter writes it
(its loader divides it back), and llama.cpp runs DeepSeek with mscale = mscale_all_dim, which transformers' yarn
and `yarn_apply_mscale` take as the same pair."""

from __future__ import annotations

import re

import torch

from weightstream.errors import WeightstreamError
from weightstream.native import BLOCK_TYPES
from weightstream.store.facts import KV_B_HALVES
from weightstream.store.gguf.families.base import DenseSource, Family, Skipped, decimal
from weightstream.store.gguf.reader import FLOATS

GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values that transformers runs
_BIAS = re.compile(r"^blk\.\d+\.exp_probs_b\.bias$")


class Deepseek2(Family):
    arch = "deepseek2"
    label = "deepseek2 (DeepSeek-V2/V3, Kimi-K2)"
    model_type = "deepseek_v3"
    experts_field = "n_routed_experts"
    norm_topk = False  # llama.cpp's default when the key is absent
    # the router and its biases: transformers keeps them float32 for these classes (`_keep_in_fp32_modules_strict`)
    # and llama.cpp's file holds them F32, so they are stored as they are (bf16 would round the biases that pick
    # experts)
    float32_keys = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    renames = (("e_score_correction_bias", "e_score_correction.bias"),)  # llama.cpp: `exp_probs_b.bias`

    # ------------------------------------------------------------------------------------------------- config

    def rope_parameters(self, gf, key):
        scaling = key("rope.scaling.type", "none")
        if scaling in ("none", None):
            return None
        theta = decimal(key("rope.freq_base", 10000.0))
        where = f"{gf.path}: rope scaling {scaling!r} ({self.arch}.rope.scaling.type)"
        if scaling == "linear":
            return {
                "rope_type": "linear",
                "rope_theta": theta,
                "factor": decimal(key("rope.scaling.factor", kind=float)),
            }
        if scaling != "yarn":
            raise WeightstreamError(
                f"{where}; transformers' DeepSeek classes take none, linear or yarn from a GGUF file: this scaling is "
                "not supported"
            )
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": decimal(key("rope.scaling.factor", why="YaRN's context extension factor", kind=float)),
            "original_max_position_embeddings": key(
                "rope.scaling.original_context_length", why="YaRN's original context length"
            ),
        }
        for name, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if key(f"rope.scaling.{name}", None, kind=float) is not None:
                params[field] = decimal(key(f"rope.scaling.{name}", kind=float))
        for name in ("yarn_ext_factor", "yarn_attn_factor", "attn_factor"):
            if key(f"rope.scaling.{name}", None, kind=float) is not None:
                raise WeightstreamError(
                    f"{where} with {self.arch}.rope.scaling.{name} = {key(f'rope.scaling.{name}', kind=float)}: "
                    "transformers' "
                    "DeepSeek classes scale YaRN attention by mscale_all_dim alone, with no such setting; not supported"
                )
        multiplier = key("rope.scaling.yarn_log_multiplier", None, kind=float)
        if multiplier is None:
            raise WeightstreamError(
                f"{where} without {self.arch}.rope.scaling.yarn_log_multiplier: llama.cpp then scales attention its "
                "own way (1 + 0.1 ln(factor) on the rotary dims and the softmax scale), which transformers' DeepSeek "
                "classes do not; convert the model again with a current llama.cpp"
            )
        # the converter writes 0.1 x mscale_all_dim (0.0707 for 0.707), llama.cpp's loader divides it by 0.1f
        # again; mscale = mscale_all_dim is what llama.cpp runs DeepSeek with (its rope then has no magnitude
        # correction). Divided as decimals, 0.0707 gives back 0.707 (float32 division: 0.70699996)
        mscale = decimal(decimal(multiplier) / 0.1)
        params["mscale"] = params["mscale_all_dim"] = mscale
        return params

    def config(self, gf, key, fields):
        heads = fields["num_attention_heads"]
        rope = key("rope.dimension_count", why="rotary dims of a head (qk_rope_head_dim)")
        if key("attention.key_length_mla", None) is not None:
            qk = key("attention.key_length_mla")
            v = key("attention.value_length_mla", why="value head size (v_head_dim)")
        else:  # files from before llama.cpp converted MLA to its MQA form
            qk = key("attention.key_length", why="query/key head size (qk_nope_head_dim + qk_rope_head_dim)")
            v = key("attention.value_length", why="value head size (v_head_dim)")
        fields.pop("head_dim")  # DeepSeek's configs derive it (the rope dims)
        fields["num_key_value_heads"] = heads  # llama.cpp's MQA form says 1; kv_b gives every head its own
        leading = key("leading_dense_block_count", 0)
        fields |= {
            "q_lora_rank": key("attention.q_lora_rank", None),
            "kv_lora_rank": key("attention.kv_lora_rank", why="the compressed key/value width (kv_lora_rank)"),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": qk - rope,
            "v_head_dim": v,
            "n_shared_experts": key("expert_shared_count", why="shared experts per layer"),
            "first_k_dense_replace": leading,
        }
        if leading:
            fields["intermediate_size"] = key("feed_forward_length", why="width of the leading dense layers")
        fields["routed_scaling_factor"] = decimal(key("expert_weights_scale", 0.0)) or 1.0
        gating = key("expert_gating_func", None)
        biases = sorted(n for n in gf.tensors if _BIAS.match(n))
        if gating is not None and gating not in GATING:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.expert_gating_func is {gating}; transformers' DeepSeek classes score experts "
                "by softmax (1: DeepseekV2) or sigmoid (2: DeepseekV3): this scoring function is not supported"
            )
        groups, used = key("expert_group_count", None), key("expert_group_used_count", None)
        if gating == 2 or (gating is None and biases):
            fields["model_type"] = "deepseek_v3"
            fields["n_group"], fields["topk_group"] = groups or 1, used or 1
            fields["num_nextn_predict_layers"] = 0  # llama.cpp's converter drops DeepSeek's MTP layer
            return
        if biases:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.expert_gating_func is 1 (softmax) and the file has routing biases "
                f"({biases[0]}); transformers' DeepseekV2 (softmax) has no such bias and DeepseekV3 scores by "
                "sigmoid: not supported"
            )
        if fields["norm_topk_prob"]:
            raise WeightstreamError(
                f"{gf.path}: {self.arch}.expert_weights_norm is true with softmax scoring; transformers' DeepseekV2 "
                "never renormalizes the top-k weights: not supported"
            )
        fields["model_type"] = "deepseek_v2"
        fields["n_group"], fields["topk_group"] = groups, used
        fields["topk_method"] = "group_limited_greedy" if groups and groups > 1 else "greedy"

    # ------------------------------------------------------------------------------------------------ tensors

    def dense_source(self, gf, key, shape, names, config):
        whole = self.gguf_name(names, key, gf)
        if not key.endswith(".self_attn.kv_b_proj.weight") or whole in gf.tensors:
            return super().dense_source(gf, key, shape, names, config)
        k_name, v_name = (whole.replace("attn_kv_b", f"attn_{p}_b") for p in ("k", "v"))
        if k_name not in gf.tensors or v_name not in gf.tensors:
            what = " and ".join(repr(n) for n in (k_name, v_name) if n not in gf.tensors)
            self.tensor(gf, whole, key, config, also=f", and so is its split form ({what} missing)")
        k_b, v_b = gf.tensors[k_name], gf.tensors[v_name]
        heads, lora = config.num_attention_heads, config.kv_lora_rank
        nope, v = config.qk_nope_head_dim, config.v_head_dim
        for t, want in ((k_b, (heads, lora, nope)), (v_b, (heads, v, lora))):
            if t.shape != want:
                raise WeightstreamError(
                    f"{gf.path}: tensor {t.name!r} is shaped {list(t.shape)}; the {config.model_type} model the "
                    f"metadata describes needs {list(want)} to rebuild {key} (heads, rows, inputs): the metadata and "
                    "the tensors disagree"
                )

        def join(values: list[torch.Tensor]) -> torch.Tensor:  # (heads, nope + v, lora): k_b's rows, then v_b's
            k, vv = (x.float() for x in values)  # the halves may differ in type
            return torch.cat([k.transpose(1, 2), vv], dim=1).reshape(heads * (nope + v), lora)

        why = (
            "kv_b_proj re-joined from attn_k_b and attn_v_b: llama.cpp stores k_b transposed, so its blocks are not "
            "rows of kv_b_proj"
        )
        return DenseSource((k_b, v_b), build=join, why_float=why)

    def kept_apart(self, key, source, config):
        if not key.endswith(".self_attn.kv_b_proj.weight") or source.build is None:
            return []
        if any(t.type in FLOATS or t.type not in BLOCK_TYPES for t in source.parts):
            return []  # bf16/f16 halves join without loss (or with the loss the import states)
        heads, lora = config.num_attention_heads, config.kv_lora_rank
        k_b, v_b = source.parts
        prefix = key.removesuffix("kv_b_proj.weight")
        return [
            (f"{prefix}{KV_B_HALVES[0]}.weight", k_b, (heads * lora, config.qk_nope_head_dim)),
            (f"{prefix}{KV_B_HALVES[1]}.weight", v_b, (heads * config.v_head_dim, lora)),
        ]

    def skipped(self, gf, config):
        out = super().skipped(gf, config)
        halves = []
        for layer in range(config.num_hidden_layers):
            if f"blk.{layer}.attn_kv_b.weight" in gf.tensors:
                halves += [n for p in ("k", "v") if (n := f"blk.{layer}.attn_{p}_b.weight") in gf.tensors]
        if halves:
            out.append(
                Skipped(
                    tuple(halves),
                    f"{len(halves)} attn_k_b/attn_v_b tensor(s) not read: attn_kv_b holds the same weights whole",
                )
            )
        return out


FAMILY = Deepseek2()
