"""Which kernel computes an experts module on this machine: the one named, else the proven eager form or the
one-expert view; a quantized checkpoint's kernel, checked on this model's shapes against the dequantized product
before it is trusted (`quantized_kernel_for`), with the tolerances that check allows.
"""

from __future__ import annotations

import math

import torch

from weightstream import native
from weightstream.engine.kernels.eager import _EAGER, Kernel, OneExpertEager, Params, eager_kernel_for, prove
from weightstream.engine.kernels.quantized import QuantizedExperts, quantized_experts
from weightstream.errors import WeightstreamError
from weightstream.store.quant.manifest import QuantFormat
from weightstream.store.quant.plan import quantize_expert
from weightstream.store.quant.torch_codes import torch_int4_layout

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
