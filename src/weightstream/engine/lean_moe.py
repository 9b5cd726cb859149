"""DeepSeek's MoE blocks on one decode row, without the steps that change nothing there.

A decode token of a model whose dense weights are GGML blocks spends a share of its time between the products: at
one row each torch call costs about as much as a small product, and a 27-layer DeepSeek pays every call 27 times a
token. DeepSeek-V3's router (`DeepseekV3TopkRouter`) converts float32 tensors to float32 and, with one group of
experts or every group chosen (`topk_group >= n_group`: V2-Lite's shape, Kimi-K2's), builds a mask of its groups
that hides nothing: some 14 calls a layer (V2's greedy router, DeepSeek-V2-Lite's: 3). `lean_moe_block` runs the
block's steps that change a value (the router's product, sigmoid or softmax, biases, top-k, weights; the experts;
the shared experts; the sum) in transformers' order, so it gives the module's bits (tested on the models, streamed
and resident). Anything but one float32 row of one sequence out of training mode, or a router with hooks, goes to
the module's own forward. Installed where `fuse_dense_ops` is (a model that computes in float32 with native dense
products); `use_native_ops(model, False)` does not switch it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightstream import native


def _one_row(x: torch.Tensor, module: torch.nn.Module) -> bool:
    return x.dim() == 3 and x.shape[:2] == (1, 1) and x.dtype is torch.float32 and not module.training


def _router(gate: torch.nn.Module, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepseekV3TopkRouter.forward`'s (top-k weights, top-k indices) of one float32 row (1, hidden) whose
    groups are all chosen: the same calls less those that leave their input as it is."""
    scores = F.linear(row, gate.weight).sigmoid()
    indices = torch.topk(scores + gate.e_score_correction_bias, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if gate.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * gate.routed_scaling_factor, indices


def _softmax_router(gate: torch.nn.Module, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepseekV2TopkRouter.forward`'s (top-k weights, top-k indices) of one float32 row (1, hidden), greedy."""
    scores = F.linear(row, gate.weight).softmax(dim=-1, dtype=torch.float32)
    weights, indices = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
    return weights * gate.routed_scaling_factor, indices


def _lean_router(module: torch.nn.Module):
    """The one-row router of a DeepSeek MoE block whose router it computes (else None): V3's where every group
    is chosen, V2's greedy one (V2-Lite's)."""
    gate = getattr(module, "gate", None)
    if gate is None or getattr(gate, "weight", None) is None or gate.weight.dtype is not torch.float32:
        return None
    kind = (type(module).__name__, type(gate).__name__)
    if kind == ("DeepseekV3MoE", "DeepseekV3TopkRouter"):
        all_groups = gate.topk_group >= gate.num_group
        return _router if all_groups and gate.e_score_correction_bias.dtype is torch.float32 else None
    if kind == ("DeepseekV2Moe", "DeepseekV2TopkRouter"):
        return _softmax_router if gate.topk_method == "greedy" else None
    return None


def lean_moe_block(module: torch.nn.Module, router):
    """A DeepSeek MoE block's forward taking `router` for one float32 row; the module's own for anything else."""
    original = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        gate = module.gate
        if not _one_row(hidden_states, module) or gate._forward_hooks or gate._forward_pre_hooks:
            return original(hidden_states)  # (hooks on the router, e.g. recording its logits: it runs as a module)
        row = hidden_states.view(1, -1)
        weights, indices = router(module.gate, row)
        out = module.experts(row, indices, weights).view(hidden_states.shape)
        return out + module.shared_experts(hidden_states)

    forward.lean_moe = True  # what install_lean_moe put (tests take it out again)
    return forward


def install_lean_moe(model: torch.nn.Module) -> list[str]:
    """Put the one-row form in the model's DeepSeek MoE blocks whose router it computes; what was changed (for the
    run's report). Needs the native kernels (a model that computes in float32 with native dense products); a no-op
    without them."""
    if not native.available():
        return []
    changed: set[str] = set()
    for module in list(model.modules()):
        router = _lean_router(module)
        if router is not None:
            module.forward = lean_moe_block(module, router)
            changed.add(f"{type(module).__name__}: one-row router")
    return sorted(changed)
