"""Quantized expert kernels: experts of a `weightstream quantize` checkpoint or a GGUF import, computed from their
packed weights (torch's int8/int4) or GGML blocks (the native kernels), and the row counts from which a product
dequantizes its weight once instead.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from transformers.integrations.moe import _default_apply_gate

from weightstream import native
from weightstream.engine.kernels.eager import Params
from weightstream.store.quant.manifest import QuantFormat
from weightstream.store.quant.torch_codes import dequantize_int4, dequantize_int8, unpack_int4

# Rows per expert from which a projection dequantizes its weight once and multiplies in the activation dtype
# instead of calling a packed-weight kernel (slow per row); benchmarks/kernel_bench.py routes measures where the two
# cross on this machine (docs/benchmarks.md). Fixed numbers, so a row count always picks the same route.
DEQUANT_ROWS = {"int8": 32, "int4": 128}
# GGML blocks: where the CPU runs the native multi-row tiles, every row count stays native. AVX-512 VNNI's tiles ran
# 256 rows of Q4_K at 2.3x, 32 rows at 2.7x the dequantize-and-F.linear route (benchmarks/llamacpp.py products --rows).
# AVX2's (AMD EPYC, 2048 x 2048, 2 threads, ms, tiles / dequantized with bfloat16 rows / with float32 rows;
# `benchmarks/kernel_bench.py dequant --dtype`): Q4_K 256 rows 10.1 / 103 / 14.0, 32 rows 1.8 / 14.7 / 3.7; Q6_K 256
# rows 14.1 / 107 / 23.9; Q8_0 256 rows 18.1 / 113 / 13.8, the one case float32 rows gain by dequantizing. A CPU
# without AVX2 dequantizes from this many rows.
NATIVE_DEQUANT_ROWS = 16
# BF16 weights, whose products are float and rows only, cross later: one 2048 x 2048 product, 2 threads (AMD EPYC,
# AVX-512; `benchmarks/kernel_bench.py dequant`, two runs), rows / dequantized and F.linear in ms: 16 rows 1.11 / 1.38
# and 1.13 / 1.40, 24 rows 1.63 / 1.69 and 1.64 / 1.65, 28 rows 1.91 / 1.91 and 1.89 / 1.90, 32 rows 2.26 / 2.05 and
# 2.20 / 2.04. A multi-row BF16 product (each weight widened once for 2-4 rows) gained nothing: the rows re-read the
# activations from L2 for every weight row, whatever widens the weights.
BF16_DEQUANT_ROWS = 24


def native_dequant_rows(wtypes) -> float:
    """Rows from which products of these block types dequantize the weight and call F.linear (inf: never)."""
    types = set(wtypes)
    if types == {"BF16"}:
        return BF16_DEQUANT_ROWS
    if native.tiles_available() and "BF16" not in types:
        return math.inf
    return NATIVE_DEQUANT_ROWS


def native_product(
    x: torch.Tensor, blocks: torch.Tensor, wtype: str, n: int, k: int, dequant_rows: float
) -> torch.Tensor:
    """x (rows, k) times the (n, k) weight GGML blocks encode, in x's dtype: the native product below
    `dequant_rows` (the caller's `native_dequant_rows`, decided at load), else the weight dequantized once and
    F.linear."""
    if x.shape[0] >= dequant_rows:
        return F.linear(x, native.dequantize(blocks, wtype, n, k).to(x.dtype))
    return native.qmm(x, blocks, wtype, n, k).to(x.dtype)


class QuantizedExperts:
    """Quantized experts of a `weightstream quantize` checkpoint or a GGUF import, one subclass per family of
    kernels (`PackedExperts`: torch's int8/int4 packed weights; `BlockExperts`: GGML blocks on the native kernels):
    each projection by the family's packed-weight product (few rows) or dequantized once (many rows), the module's
    own gate between them, biases as stored. `quantized_experts` picks the class."""

    fused = False  # whether `layer` / `contribute` run a whole layer in one call (BlockExperts)
    # --miss-copy: the kernel of the experts' small copies (their own block types, `quantize --miss-bits`), which
    # computes an expert whose slot holds its small copy (`ExpertSource.holds_small_copy`); None: no small copies
    small: QuantizedExperts | None = None

    def __init__(self, module: torch.nn.Module, quant: QuantFormat, dequant_rows: float):
        self.quant, self.scheme = quant, quant.scheme
        self.gate = module._apply_gate if module.has_gate else module.act_fn
        self.up = "gate_up_proj" if module.has_gate else "up_proj"
        self.bias = module.has_bias
        self.dequant_rows = dequant_rows

    def for_layer(self, layer: int) -> QuantizedExperts:
        """This kernel for the experts of one decoder layer (whose formats may be its own)."""
        return self

    def layer_fits(self, rows_per_expert: int) -> bool:
        """Whether a layer whose busiest expert has this many rows runs as one call (`layer`)."""
        return False

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, params: Params) -> torch.Tensor:
        hidden = self.gate(self.project(rows, params, self.up))  # (n, I)
        return self.project(hidden, params, "down_proj") * weights  # (n, D)

    def project(self, x: torch.Tensor, params: Params, name: str) -> torch.Tensor:
        y = self.product(x, params, name)
        return y + params[f"{name}_bias"] if self.bias else y

    def product(self, x: torch.Tensor, params: Params, name: str) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor | None = None, name: str | None = None) -> torch.Tensor:
        raise NotImplementedError


class PackedExperts(QuantizedExperts):
    """int8 / int4 experts packed for torch's CPU kernels (`quantize --kernel torch`), with their scales."""

    def __init__(self, module: torch.nn.Module, quant: QuantFormat):
        super().__init__(module, quant, DEQUANT_ROWS[quant.scheme])
        self.name = f"{quant.scheme}-packed"
        self.group, self.layout = quant.group_size, quant.int4_layout

    def product(self, x: torch.Tensor, params: Params, name: str) -> torch.Tensor:
        q, scales = params[f"{name}.qweight"], params[f"{name}.scales"]
        if x.shape[0] >= self.dequant_rows:
            return F.linear(x, self.dequantize(q, scales))
        if self.scheme == "int8":
            return torch._weight_int8pack_mm(x, q, scales)
        return torch._weight_int4pack_mm_for_cpu(x, q, self.group, scales)

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor | None = None, name: str | None = None) -> torch.Tensor:
        if self.scheme == "int8":
            return dequantize_int8(q, scales)
        return dequantize_int4(unpack_int4(q, self.layout), scales, self.group)


class BlockExperts(QuantizedExperts):
    """Experts as GGML blocks (Q4_K, Q6_K, Q8_0, MXFP4, ... of `quantize` or a GGUF import) on the native kernels;
    a layer whose gate the extension runs (`fused_gate`) is one native call (`layer`, `contribute`)."""

    def __init__(self, module: torch.nn.Module, quant: QuantFormat):
        self.blocks = self._blocks(quant.tensors)
        super().__init__(module, quant, native_dequant_rows(self._types(self.blocks)))
        self.name = f"{quant.scheme}-native"
        # one native call per layer (every routed expert's gate_up, gate, down, biases, router weight, and their
        # sum) where the module's gate is one the extension runs; any other runs expert by expert
        self.gate_kind = fused_gate(module) if module.has_gate else None
        self.fused = self.gate_kind is not None

    @staticmethod
    def _blocks(table) -> dict:
        return {t.name: (t.dtype, *t.shape) for t in table if len(t.shape) == 2}

    @staticmethod
    def _types(blocks: dict) -> list[str]:
        return [wtype for wtype, *_ in blocks.values()]

    def for_layer(self, layer: int) -> BlockExperts:
        if not self.quant.layer_tables or layer not in self.quant.layer_tables:
            return self
        kernel = copy.copy(self)
        kernel.blocks = self._blocks(self.quant.table(layer)[0])
        kernel.dequant_rows = native_dequant_rows(self._types(kernel.blocks))
        return kernel

    def layer_fits(self, rows_per_expert: int) -> bool:
        return self.fused and rows_per_expert < self.dequant_rows

    def layer(self, x, top_k_index, top_k_weights, experts: list[int], params: list[Params]) -> torch.Tensor:
        """The layer's combined expert output in one native call, every routed expert at hand."""
        return native.moe_layer(x, top_k_index, top_k_weights, experts, **self._layer_args(params))

    def contribute(self, contrib, x, top_k_index, top_k_weights, experts: list[int], params: list[Params]) -> None:
        """`layer` for some of the experts, into contrib (float32 (tokens, top_k, hidden)); `native.moe_sum` adds."""
        native.moe_layer(x, top_k_index, top_k_weights, experts, **self._layer_args(params), into=contrib)

    def _layer_args(self, params: list[Params]) -> dict:
        gate, alpha, limit = self.gate_kind
        args = {
            "gate_up": [p["gate_up_proj.qweight"] for p in params],
            "gate_up_type": self.blocks["gate_up_proj.qweight"][0],
            "down": [p["down_proj.qweight"] for p in params],
            "down_type": self.blocks["down_proj.qweight"][0],
            "gate": gate,
            "alpha": alpha,
            "limit": limit,
        }
        if self.bias:
            args["gate_up_bias"] = [p["gate_up_proj_bias"] for p in params]
            args["down_bias"] = [p["down_proj_bias"] for p in params]
        return args

    def product(self, x: torch.Tensor, params: Params, name: str) -> torch.Tensor:
        return native_product(x, params[f"{name}.qweight"], *self.blocks[f"{name}.qweight"], self.dequant_rows)

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor | None = None, name: str | None = None) -> torch.Tensor:
        return native.dequantize(q, *self.blocks[f"{name}.qweight"])


def quantized_experts(module: torch.nn.Module, quant: QuantFormat) -> QuantizedExperts:
    """The kernel class of this checkpoint's quantized experts."""
    return BlockExperts(module, quant) if quant.native else PackedExperts(module, quant)


def fused_gate(module: torch.nn.Module) -> tuple[str, float, float] | None:
    """The gate `native.moe_layer` runs for this experts module, as (gate, alpha, limit): SiLU on stacked gate/up
    rows (transformers' default gate), or gpt-oss's clamped SwiGLU on interleaved rows, its own `_apply_gate` shown
    to be that function on values across its clamps; None for any other gate (the experts then run one by one)."""
    act = type(getattr(module, "act_fn", None)).__name__
    if getattr(type(module), "_apply_gate", None) is _default_apply_gate and act in ("SiLU", "SiLUActivation"):
        return ("silu", 0.0, 0.0)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not (isinstance(alpha, float) and isinstance(limit, float) and hasattr(module, "_apply_gate")):
        return None
    probe = torch.linspace(-2 * limit, 2 * limit, 64).reshape(2, 32)  # (rows, 2I): both sides of both clamps
    g, u = probe[..., ::2].clamp(max=limit), probe[..., 1::2].clamp(-limit, limit)
    try:
        shown = torch.allclose(module._apply_gate(probe), (u + 1) * g * torch.sigmoid(alpha * g))
    except (RuntimeError, TypeError):
        return None
    return ("clamped-swiglu", alpha, limit) if shown else None
