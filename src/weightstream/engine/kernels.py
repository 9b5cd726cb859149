"""Expert kernels: one expert's output for its rows, from its parameters in the cache (one class per form).

A kernel is called as `kernel(rows, weights, params)`: rows (n, D) are the hidden states routed to the expert,
weights (n, 1) their router weights, params the expert's tensors (views of its slot); it returns the weighted
rows (n, D). The eager kernels repeat transformers' eager arithmetic op for op, so the result is bitwise
eager's; which architectures they serve is checked on every load against the architecture's own eager forward
(`prove`), and any other architecture runs that eager forward itself on a one-expert view (OneExpertEager).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.integrations.moe import _default_apply_gate

from weightstream import native
from weightstream.errors import WeightstreamError
from weightstream.store.quant import dequantize_int4, dequantize_int8, torch_int4_layout, unpack_int4
from weightstream.store.quant_format import QuantFormat

Params = dict[str, torch.Tensor]


class EagerLinear:
    """Qwen3/Qwen2 MoE, Mixtral, OLMoE, DeepSeek V2/V3: linear(gate_up), act(gate) * up, linear(down), x weight."""

    name = "eager-linear"

    def __init__(self, module: torch.nn.Module):
        self.act = getattr(module, "act_fn", None)  # None: not this form (prove says so)

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, params: Params) -> torch.Tensor:
        gate, up = F.linear(rows, params["gate_up_proj"]).chunk(2, dim=-1)  # (n, I) each
        return F.linear(self.act(gate) * up, params["down_proj"]) * weights  # (n, D)


class EagerMatmulBias:
    """gpt-oss: weights stored transposed, biases, its own clamped gate: x @ W + b, gate, @ W + b, x weight."""

    name = "eager-matmul-bias"

    def __init__(self, module: torch.nn.Module):
        self.apply_gate = module._apply_gate

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, params: Params) -> torch.Tensor:
        gate_up = rows @ params["gate_up_proj"] + params["gate_up_proj_bias"]  # (n, 2I)
        return (self.apply_gate(gate_up) @ params["down_proj"] + params["down_proj_bias"]) * weights


class OneExpertEager:
    """Any architecture: its own eager forward, run on a view of the module holding one expert (the slot)."""

    name = "one-expert-eager"

    def __init__(self, module: torch.nn.Module):
        self.module, self.forward = module, eager_forward_of(module)

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, params: Params) -> torch.Tensor:
        view = copy.copy(self.module)  # shares act_fn, norms and settings; gets its own parameter table
        view._parameters = {name: p.unsqueeze(0) for name, p in params.items()}  # (1, ...) like (E, ...)
        view.num_experts = 1
        index = torch.zeros(weights.shape, dtype=torch.long)  # every row chose expert 0 of the view
        return self.forward(view, rows, index, weights)  # its own index_add_ into zeros: the weighted rows


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


class NativeLinear(torch.nn.Module):
    """A dense Linear whose weight is GGML blocks (`quantize --dense`), computed as the experts' are
    (`native_product`)."""

    def __init__(self, blocks: torch.Tensor, wtype: str, n: int, k: int, bias: torch.nn.Parameter | None):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.wtype, self.in_features, self.out_features = wtype, k, n
        self.bias = bias
        self.dequant_rows = native_dequant_rows((wtype,))  # decided once: forward is on every token's path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.dequant_rows * self.in_features:  # one op, as native_product's product
            return native.linear(x, self.blocks, self.wtype, self.out_features, self.in_features, self.bias)
        rows = x.reshape(-1, self.in_features)
        y = native_product(rows, self.blocks, self.wtype, self.out_features, self.in_features, self.dequant_rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class StoredEmbedding(torch.nn.Module):
    """An input embedding kept in the dtype it is stored in (a buffer, so the model's dtype is that of its
    parameters), its rows converted to the compute dtype as they are looked up: a quantized-dense model computes
    in float32 without a float32 copy of the table, of which a token reads one row."""

    def __init__(self, table: torch.Tensor, padding_idx: int | None, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", table, persistent=False)
        self.padding_idx, self.dtype = padding_idx, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.dtype)


Kernel = Callable[[torch.Tensor, torch.Tensor, Params], torch.Tensor]
_EAGER = {"eager-linear": EagerLinear, "eager-matmul-bias": EagerMatmulBias}


def eager_forward_of(module: torch.nn.Module):
    """The architecture's own eager forward, which the experts interface wraps."""
    return type(module).forward.__wrapped__


def eager_kernel_for(module: torch.nn.Module) -> Kernel:
    """The lean kernel whose arithmetic is this module's eager forward, proven on random weights; else the view."""
    form = "eager-matmul-bias" if module.is_transposed else "eager-linear"
    if module.has_gate and module.has_bias == module.is_transposed and not module.has_post_expert_norm:
        kernel = _EAGER[form](module)
        if prove(kernel, module):
            return kernel
    return OneExpertEager(module)


def prove(kernel: Kernel, module: torch.nn.Module, rows: tuple[int, ...] = (1, 3)) -> bool:
    """Whether `kernel` gives bitwise the module's eager output, on random weights of its shapes (1 and 3 rows)."""
    gen = torch.Generator().manual_seed(0)
    params = {}
    for name, meta in module.named_parameters(recurse=False):
        params[name] = torch.randn(meta.shape[1:], generator=gen, dtype=torch.float32).mul_(0.05).to(meta.dtype)
    dtype = next(iter(params.values())).dtype
    hidden = params["down_proj"].shape[0 if not module.is_transposed else 1]
    reference = OneExpertEager(module)
    for n in rows:
        x = torch.randn(n, hidden, generator=gen, dtype=torch.float32).to(dtype)
        w = torch.rand(n, 1, generator=gen, dtype=torch.float32).to(dtype)
        try:
            if not torch.equal(kernel(x, w, params), reference(x, w, params)):
                return False
        except (RuntimeError, KeyError, TypeError):  # not this form: a parameter or the activation is missing
            return False
    return True


KERNELS = ("auto", *_EAGER, OneExpertEager.name)


def check_kernel_name(name: str) -> None:
    if name not in KERNELS:
        raise WeightstreamError(f"--expert-kernel {name!r}: choose one of {', '.join(KERNELS)}")


def choose_kernel(
    module: torch.nn.Module, name: str = "auto", quant: QuantFormat | None = None, miss_copy: bool = False
) -> Kernel:
    """The kernel for this experts module: `auto` (proven lean kernel, else the view), or the one named; a
    quantized checkpoint's experts take the quantized kernel, checked on this machine first (and with `miss_copy`
    its small copies' kernel)."""
    if quant is not None:
        return quantized_kernel_for(module, quant, name, miss_copy)
    if name == "auto":
        return eager_kernel_for(module)
    if name == OneExpertEager.name:
        return OneExpertEager(module)
    kernel = _EAGER[name](module)
    if not prove(kernel, module):
        raise WeightstreamError(
            f"--expert-kernel {name}: not bitwise equal to the eager forward of {type(module).__name__}; use auto"
        )
    return kernel


def quantized_kernel_for(
    module: torch.nn.Module, quant: QuantFormat, name: str = "auto", miss_copy: bool = False
) -> QuantizedExperts:
    """The quantized kernel, once this machine's torch is shown to pack and multiply as the checkpoint assumes; with
    `miss_copy`, its `small` computes the small copies (checked the same way)."""
    if name != "auto":
        raise WeightstreamError(
            f"--expert-kernel {name}: a quantized checkpoint's experts run its "
            f"{quant.scheme} kernel; leave --expert-kernel at auto"
        )
    if quant.native and not native.available():
        raise WeightstreamError(
            f"{quant.scheme} experts need weightstream's native kernels, which are not available here "
            f"({native.why_not()}); or quantize the original checkpoint with --kernel torch"
        )
    if quant.scheme == "int4" and torch_int4_layout() != quant.int4_layout:
        raise WeightstreamError(
            f"int4 experts were packed in torch's {quant.int4_layout!r} CPU layout; this machine's torch packs "
            f"{torch_int4_layout()!r} (the layout follows the CPU's vector width): run `weightstream quantize` again "
            "on this machine"
        )
    kernel = _checked(module, quant)
    if miss_copy:
        kernel.small = _checked(module, quant.miss_format())
    return kernel


def _checked(module: torch.nn.Module, quant: QuantFormat) -> QuantizedExperts:
    kernel = quantized_experts(module, quant)
    error, tolerance = quantized_error(kernel, module, quant), quant_tolerance(quant)
    if not error < tolerance:
        raise WeightstreamError(
            f"the {kernel.name} kernel is off by {error:.1%} on this model's shapes on this machine (more than "
            f"{tolerance:.0%} of the dequantized product); its weights cannot be computed here"
        )
    return kernel


QUANT_TOLERANCE = 0.03  # relative to the product with dequantized weights: rounding of the activation dtype
# the native kernels also round the activations to 8 bits per block (docs/kernels.md): 2-3.2% of the largest
# output on random weights of the test models' and OLMoE's shapes in float32; a wrong kernel is off by far more
NATIVE_TOLERANCE = 0.05


def quant_tolerance(quant: QuantFormat) -> float:
    """How far the load-time check lets the quantized kernel be from the product with dequantized weights."""
    return NATIVE_TOLERANCE if quant.native else QUANT_TOLERANCE


def quantized_error(kernel: QuantizedExperts, module: torch.nn.Module, quant: QuantFormat) -> float:
    """Largest relative error of `kernel` against eager on the same dequantized weights (random, this model's
    shapes), over row counts on both routes. torch's int8 kernel silently returns wrong values for some shapes."""
    from weightstream.store.quantize import quantize_expert

    gen = torch.Generator().manual_seed(0)
    dense = {}
    for name, meta in module.named_parameters(recurse=False):
        dense[name] = torch.randn(meta.shape[1:], generator=gen, dtype=torch.float32).mul_(0.05).to(meta.dtype)
    blob_params = quantize_expert(dense, module.is_transposed, quant)
    reference = OneExpertEager(module)
    deq = {name: _dequantized(kernel, blob_params, name, module.is_transposed, dense[name]) for name in dense}
    hidden = dense["down_proj"].shape[0 if not module.is_transposed else 1]
    worst = 0.0
    dtype = dense["down_proj"].dtype  # the dtype the model computes in (QuantFormat.compute_dtype)
    # both routes: one row, a few, and the first row count of the dequantized route (or the tiles' many rows)
    for n in (1, 3, kernel.dequant_rows if math.isfinite(kernel.dequant_rows) else 24):
        x = torch.randn(n, hidden, generator=gen, dtype=torch.float32).to(dtype)
        w = torch.ones(n, 1, dtype=dtype)
        want = reference(x, w, deq).float()
        got = kernel(x, w, blob_params).float()
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp(min=1e-6)))
    return worst


def _dequantized(kernel: QuantizedExperts, params: Params, name: str, transposed: bool, like: torch.Tensor):
    if f"{name}.qweight" not in params:
        return params[name]  # a bias, stored as is
    w = kernel.dequantize(params[f"{name}.qweight"], params.get(f"{name}.scales"), name).to(like.dtype)
    return w.t().contiguous() if transposed else w
