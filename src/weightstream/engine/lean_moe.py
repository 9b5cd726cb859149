"""DeepSeek's MoE blocks and gated MLPs on one decode row, without the steps that change nothing there.

A decode token of a model whose dense weights are GGML blocks spends a share of its time between the products: at
one row each torch call costs about as much as a small product, and a 27-layer DeepSeek pays every call 27 times a
token. Two of transformers' modules do more calls than their arithmetic needs at one row:

- DeepSeek-V3's router (`DeepseekV3TopkRouter`) converts float32 tensors to float32 and, with one group of experts
  or every group chosen (`topk_group >= n_group`: V2-Lite's shape, Kimi-K2's), builds a mask of its groups that
  hides nothing: some 14 calls a layer (V2's greedy router, DeepSeek-V2-Lite's, 3). `lean_moe_block` runs the
  block's steps that change a value (the router's product, sigmoid or softmax, biases, top-k, weights; the
  experts; the shared experts; the sum) in transformers' order.
- A gated MLP (`down(act(gate(x)) * up(x))`: the shared experts, DeepSeek's first dense layers and most dense
  models' MLPs) multiplies the row by gate and up apart. Where both are NativeLinear of one block type, their
  blocks are put in one tensor (gate's rows, then up's; each keeps a view of its own rows, so nothing is held
  twice) and a row is one native product for both: the row is quantized once and each output is the same dot
  product of the same blocks.

Both are exact: the same ops on the same values (the MoE block: tested on the models, streamed and resident), or a
product whose rows are computed as before (each gated MLP proven at load on random rows against its own forward).
Anything but one float32 row of one sequence out of training mode goes to the module's own forward. Installed where
`fuse_dense_ops` is (a model that computes in float32 with native dense products); `use_native_ops(model, False)`
does not switch them off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weightstream import native
from weightstream.engine.kernels.dense import NativeLinear


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
        if not _one_row(hidden_states, module):
            return original(hidden_states)
        row = hidden_states.view(1, -1)
        weights, indices = router(module.gate, row)
        out = module.experts(row, indices, weights).view(hidden_states.shape)
        return out + module.shared_experts(hidden_states)

    return forward


class _GatedRow:
    """A gated MLP's forward taking one native product for gate and up on one row."""

    def __init__(self, module: torch.nn.Module, original):
        self.module, self.original = module, original
        gate, up = module.gate_proj, module.up_proj
        both = torch.cat([gate.blocks, up.blocks])  # (2 I, row bytes): gate's rows, then up's
        gate.blocks, up.blocks = both[: gate.out_features], both[gate.out_features :]
        self.blocks, self.wtype, self.width, self.inputs = both, gate.wtype, gate.out_features, gate.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not _one_row(x, m):
            return self.original(x)
        gate_up = native.linear(x, self.blocks, self.wtype, 2 * self.width, self.inputs, None)
        gate, up = gate_up.split(self.width, dim=-1)
        return m.down_proj(m.act_fn(gate) * up)


def _gated_pair(module: torch.nn.Module) -> bool:
    """Whether a module is a gated MLP (gate_proj, up_proj, down_proj, act_fn) whose gate and up are bias-less
    NativeLinear of one block type and width."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (
        isinstance(gate, NativeLinear)
        and isinstance(up, NativeLinear)
        and isinstance(getattr(module, "down_proj", None), torch.nn.Module)
        and callable(getattr(module, "act_fn", None))
        and gate.bias is None
        and up.bias is None
        and gate.wtype == up.wtype
        and (gate.in_features, gate.out_features) == (up.in_features, up.out_features)
    )


def _proves(module: torch.nn.Module, forward, original) -> bool:
    """Whether `forward` gives the module's own output bitwise on random rows."""
    gen = torch.Generator().manual_seed(0)
    width = module.gate_proj.in_features if hasattr(module, "gate_proj") else module.gate.weight.shape[1]
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(1, 1, width, generator=gen)
            if not torch.equal(forward(x), original(x)):
                return False
    return True


def install_lean_moe(model: torch.nn.Module) -> list[str]:
    """Put the one-row forms in the model's gated MLPs and DeepSeek-V3 MoE blocks where they prove equal; the
    classes changed (for the run's report). Needs the native kernels; a no-op without them."""
    if not native.available():
        return []
    changed: set[str] = set()
    for module in list(model.modules()):
        if _gated_pair(module):
            original = module.forward
            gated = _GatedRow(module, original)
            if _proves(module, gated, original):
                module.forward = gated
                changed.add(f"{type(module).__name__}: gate and up in one product")
    for module in list(model.modules()):
        router = _lean_router(module)
        if router is not None:
            module.forward = lean_moe_block(module, router)
            changed.add(f"{type(module).__name__}: one-row router")
    return sorted(changed)
