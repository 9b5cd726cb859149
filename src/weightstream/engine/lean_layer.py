"""A DeepSeek decoder layer's decode row in three native calls (csrc/decode.cpp) and its experts' own.

At one row a token of a DeepSeek model whose dense weights are GGML blocks is a chain of native products, and the
Python and torch calls between them are a share of it that the arithmetic does not explain: replaying one token's
recorded ops back to back (2026-12-07, 2 vCPUs of an AMD EPYC Zen 4, depth 256) took 14.6 ms of its 16.7 on the
4-layer V3-lite shape and 61.7 of 70.7 on the 27-layer V2-Lite shape. A layer's attention half (its input norm,
`LatentAttention.decode`'s projections, norms, rotation, cache write, absorbed attention and output projection, the
residual sum and the post-attention norm) is some 40 such calls; `mla_decode` makes them in C++, calling the same
ops through the dispatcher in the same order on the same values. The MLP half likewise: a dense MLP, or a MoE
block's shared experts, the sum with its routed experts and the residual sum, in `mlp_decode`; a MoE block's router
(engine/lean_moe.py's one-row form) in `route_decode`, the same ATen calls; between them the experts module runs as
it always does (the expert cache, streamed or resident). So the layer gives the bits its modules give
(tests/test_gguf_import_families.py compares them step by step). Measured 2026-12-07 at depth 256, the layers' own
forwards and these alternating two tokens at a time in one process (200 and 120 tokens): 13.49 against 14.42 ms a
token on the 4-layer shape, 67.08 against 69.87 on the 27-layer one (the attention half alone: 14.49 against 15.00
and 68.86 against 70.76).

`install_lean_layers` gives each DeepSeek-V2/V3 decoder layer whose attention the call covers (absorbed, k_b and v_b
as native blocks, NativeLinear projections without biases, native RMSNorms, a native rotary function) a forward that
takes it for one float32 row of one sequence on the engine's cache (a `GrowingLayer` already holding the prompt),
with a mask that hides nothing, no hooks on the modules it skips and the native ops still in place
(`use_native_ops(model, False)` puts transformers' back: the layer then runs its own forward); the MLP half goes
native where `LeanMlp.of` covers it and the MoE block still runs its one-row form, else as the module's call. Any
other call runs the layer's own forward.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.modules import module as torch_module

from weightstream import native
from weightstream.engine.fused import NativeRMSNorm, NativeRotary
from weightstream.engine.kernels.dense import NativeLinear
from weightstream.engine.kv_cache import GrowingLayer
from weightstream.engine.latent_attention import LEAN_CLASSES, _sees_everything
from weightstream.engine.lean_moe import _lean_router, _router

LEAN_LAYERS = ("DeepseekV3DecoderLayer", "DeepseekV2DecoderLayer")
DENSE_MLPS = ("DeepseekV3MLP", "DeepseekV2MLP")
SILU = ("SiLU", "SiLUActivation")
ROPE, ROPE_INTERLEAVED, PAIRS = 0, 1, 2  # csrc/decode.cpp's RotKind
_KNOWN = frozenset(
    {"hidden_states", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache"}
    | {"position_embeddings", "cache_position"}
)


class LeanLayer:
    """What `mla_decode` takes of one decoder layer: its projections' blocks and sizes, its norms, k_b and v_b."""

    def __init__(self, layer: torch.nn.Module):
        attention = layer.self_attn
        latent = attention._ws_latent
        self.projections, norm_slots = _attention_parts(layer)
        # where the norms sit, in the order `mla_decode` takes them: `use_native_ops(model, False)` puts
        # transformers' modules back there
        self.slots = [(parent, name, getattr(parent, name)) for parent, name in norm_slots]
        self.norm_modules = [norm for _, _, norm in self.slots]
        self.w, self.types, self.rows, self.cols = _block_args(self.projections)
        self.norms = [n.weight for n in self.norm_modules]
        self.eps = [float(n.eps) for n in self.norm_modules]
        self.k_b, self.k_type = latent.k_rows, native.TYPE_IDS[latent.k_type]
        self.v_b, self.v_type = latent.v_rows, native.TYPE_IDS[latent.v_type]
        self.dims = [latent.heads, latent.nope, latent.rope, latent.v, latent.kv_lora]
        self.scale = float(attention.scaling)
        self.latent, self.rope = latent, latent.rope
        # V3: the modeling module's rotary function (its `rope_interleave` form), native while fuse_dense_ops's
        # replacement is in place; V2: complex frequencies, by the native op once LatentAttention proved it
        modeling = sys.modules[type(attention).__module__]
        interleaved = bool(getattr(attention.config, "rope_interleave", False))
        self.rotary_name = "apply_rotary_pos_emb_interleave" if interleaved else "apply_rotary_pos_emb"
        self.modeling, self.rot_kind = modeling, ROPE_INTERLEAVED if interleaved else ROPE
        # modules whose forward the call stands for: hooks on any of them send the row to the layer's own forward
        self.skipped = [attention, *self.projections, *self.norm_modules]

    def rotation(self, rotary) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
        """(rot_a, rot_b, kind) for `mla_decode` from the model's position embeddings of one row, or None where the
        native op is not what the layer's own rotary function would run."""
        if isinstance(rotary, torch.Tensor):  # V2's complex frequencies
            native_pairs = self.latent.native_pairs and rotary.dtype is torch.complex64
            if native_pairs and rotary.device.type == "cpu" and rotary.shape == (1, 1, self.rope // 2):
                return rotary, None, PAIRS
            return None
        cos, sin = rotary
        if not isinstance(getattr(self.modeling, self.rotary_name, None), NativeRotary):
            return None
        if not all(t.dtype is torch.float32 and t.device.type == "cpu" for t in (cos, sin)):
            return None
        if cos.shape != (1, 1, self.rope) or sin.shape != cos.shape or self.rope % 2:
            return None
        return cos, sin, self.rot_kind

    def in_place(self) -> bool:
        """Whether the norm modules are still the native ones it was made from."""
        return all(getattr(parent, name) is norm for parent, name, norm in self.slots)


class LeanMlp:
    """What `mlp_decode` (and `route_decode`, for a MoE block) takes of a layer's MLP half: a dense MLP's or the
    shared experts' gate, up and down blocks; a MoE block's router. `of` makes one where the calls cover the
    module (a dense DeepSeek MLP, or a MoE block running engine/lean_moe.py's one-row form), else None."""

    def __init__(self, mlp: torch.nn.Module, dense: torch.nn.Module, router=None):
        projections = [dense.gate_proj, dense.up_proj, dense.down_proj]
        self.w, self.types, self.rows, self.cols = _block_args(projections)
        self.mlp, self.moe = mlp, router is not None
        self.skipped = [mlp, dense, *projections, dense.act_fn]
        if self.moe:
            gate = mlp.gate
            self.skipped.append(gate)
            self.router = (gate.weight, gate.e_score_correction_bias if router is _router else None)
            self.route = (0 if router is _router else 1, gate.top_k, bool(getattr(gate, "norm_topk_prob", False)))
            self.route += (float(gate.routed_scaling_factor),)

    @classmethod
    def of(cls, mlp: torch.nn.Module) -> LeanMlp | None:
        if type(mlp).__name__ in DENSE_MLPS:
            return cls(mlp, mlp) if _dense_covered(mlp) else None
        if not getattr(vars(mlp).get("forward"), "lean_moe", False):  # not the one-row form (or taken out)
            return None
        router, shared = _lean_router(mlp), getattr(mlp, "shared_experts", None)
        if router is None or type(shared).__name__ not in DENSE_MLPS or not _dense_covered(shared):
            return None
        return cls(mlp, shared, router)

    def applies(self) -> bool:
        """Whether the MoE block still runs its one-row form and no module the calls stand for has hooks."""
        if self.moe and not getattr(vars(self.mlp).get("forward"), "lean_moe", False):
            return False
        return not _hooked(self.skipped)

    def __call__(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the MLP half of `normed` (1, 1, hidden)."""
        if not self.moe:
            return native.mlp_decode(normed, residual, self.w, self.types, self.rows, self.cols)
        row = normed.view(1, -1)
        weights, indices = native.route_decode(row, *self.router, *self.route)
        routed = self.mlp.experts(row, indices, weights)
        return native.mlp_decode(normed, residual, self.w, self.types, self.rows, self.cols, routed)


def _attention_parts(layer: torch.nn.Module) -> tuple[list, list[tuple[torch.nn.Module, str]]]:
    """A DeepSeek decoder layer's attention projections in the order `mla_decode` takes them ([q_a, q_b, kv_a, o]
    with q_lora, else [q, kv_a, o]; None where one is missing), and where its norms sit, (module, attribute), in the
    order it takes those ([input, q_a with q_lora, kv_a, post-attention])."""
    attention = layer.self_attn
    q_lora = attention.q_lora_rank is not None
    queries = ["q_a_proj", "q_b_proj"] if q_lora else ["q_proj"]
    projections = [getattr(attention, name, None) for name in [*queries, "kv_a_proj_with_mqa", "o_proj"]]
    norms = [(layer, "input_layernorm"), *([(attention, "q_a_layernorm")] if q_lora else [])]
    return projections, [*norms, (attention, "kv_a_layernorm"), (layer, "post_attention_layernorm")]


def _one_call_products(projections) -> bool:
    """Whether each module is a NativeLinear without bias whose one-row forward is `native.linear` (the op the
    calls make in its place)."""
    return all(isinstance(p, NativeLinear) and p.bias is None and p.dequant_rows > 1 for p in projections)


def _block_args(projections) -> tuple[list, list[int], list[int], list[int]]:
    """The NativeLinear modules' blocks, type ids, rows and inputs, as the native calls take them."""
    return (
        [p.blocks for p in projections],
        [native.TYPE_IDS[p.wtype] for p in projections],
        [p.out_features for p in projections],
        [p.in_features for p in projections],
    )


def _hooked(modules) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _dense_covered(mlp: torch.nn.Module) -> bool:
    """Whether a DeepSeek MLP is NativeLinear gate, up and down without biases around a SiLU."""
    projections = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return _one_call_products(projections) and type(getattr(mlp, "act_fn", None)).__name__ in SILU


def _covered(layer: torch.nn.Module) -> bool:
    """Whether `mla_decode` computes this decoder layer's attention half as its modules do."""
    attention = getattr(layer, "self_attn", None)
    if type(layer).__name__ not in LEAN_LAYERS or type(attention).__name__ not in LEAN_CLASSES:
        return False
    latent = getattr(attention, "_ws_latent", None)
    if latent is None or latent.k_rows is None:
        return False
    projections, norm_slots = _attention_parts(layer)
    norms = [getattr(parent, name) for parent, name in norm_slots]
    native_norms = all(isinstance(n, NativeRMSNorm) and n.weight.dtype is torch.float32 for n in norms)
    return _one_call_products(projections) and native_norms


def install_lean_layers(model: torch.nn.Module) -> list[str]:
    """Give the model's DeepSeek decoder layers that `mla_decode` covers the one-row forward; what was changed (for
    the run's report). Needs the op (an extension built from these sources)."""
    if not native.has("mla_decode"):
        return []
    changed: set[str] = set()
    for module in list(model.modules()):
        if _covered(module):
            mlp = LeanMlp.of(module.mlp)
            module.forward = _lean_forward(module, LeanLayer(module), mlp)
            changed.add(f"{type(module).__name__}: one-call attention row")
            if mlp is not None:
                changed.add(f"{type(module).__name__}: one-call {'MoE' if mlp.moe else 'MLP'} row")
    return sorted(changed)


def _lean_forward(layer: torch.nn.Module, plan: LeanLayer, mlp: LeanMlp | None):
    original = layer.forward
    attention = layer.self_attn

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if args[1:] or not _KNOWN.issuperset(kwargs) or not _one_row(layer, hidden, cache, kwargs, plan):
            return original(*args, **kwargs)
        rotation = plan.rotation(kwargs["position_embeddings"])
        held = cache.layers[attention.layer_idx]
        used = held.reserve_row() if rotation is not None else None
        if used is None:
            return original(*args, **kwargs)
        attended, normed = native.mla_decode(hidden, plan, *rotation, held._key_buffer, held._value_buffer, used)
        held.filled(used + 1)
        if mlp is not None and mlp.applies():
            return mlp(normed, attended)
        return attended + layer.mlp(normed)

    forward.lean_layer = True  # what install_lean_layers put (tests take it out again)
    forward.original = original
    return forward


def _one_row(layer, hidden, cache, kwargs: dict, plan: LeanLayer) -> bool:
    """Whether the call is one float32 decode row of one sequence on the engine's cache, every position seen, that
    the native call computes as the layer's modules would."""
    if not isinstance(hidden, torch.Tensor) or hidden.shape[:2] != (1, 1) or hidden.dtype is not torch.float32:
        return False
    if cache is None or getattr(cache, "offloading", False) or layer.training:
        return False
    idx = layer.self_attn.layer_idx
    if idx >= len(cache.layers) or type(cache.layers[idx]) is not GrowingLayer:
        return False
    if kwargs.get("position_embeddings") is None or not _sees_everything(kwargs.get("attention_mask")):
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    if _hooked(plan.skipped):
        return False
    return plan.in_place()
