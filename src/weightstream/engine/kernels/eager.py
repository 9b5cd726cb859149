"""Eager expert kernels: one expert's output for its rows, from its parameters in the cache (one class per form).

A kernel is called as `kernel(rows, weights, params)`: rows (n, D) are the hidden states routed to the expert,
weights (n, 1) their router weights, params the expert's tensors (views of its slot); it returns the weighted
rows (n, D). The eager kernels repeat transformers' eager arithmetic op for op, so the result is bitwise
eager's; which architectures they serve is checked on every load against the architecture's own eager forward
(`prove`), and any other architecture runs that eager forward itself on a one-expert view (OneExpertEager).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]
Kernel = Callable[[torch.Tensor, torch.Tensor, Params], torch.Tensor]


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
