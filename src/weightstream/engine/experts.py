"""The `weightstream` experts implementation for transformers: each expert's weights come from the expert cache.

Exactness: every expert is computed by the architecture's own eager forward, run on a one-expert view of the
module whose weights are the cached slot, on exactly the rows (and row order) eager gives that expert. The
contributions are then added into the output in ascending expert order, as eager does. So results are
bitwise those of `experts_implementation="eager"`, whatever order the reads complete in.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

IMPLEMENTATION = "weightstream"


def weightstream_experts_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Drop-in for the experts forward: (hidden_states, top_k_index, top_k_weights) -> combined expert output."""
    top_k_index, top_k_weights = (list(args) + list(kwargs.values()))[:2]
    return self._ws_runtime.experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, weightstream_experts_forward)


def eager_forward_of(module: torch.nn.Module):
    """The architecture's own eager forward, which the experts interface wraps."""
    return type(module).forward.__wrapped__


def routed_rows(top_k_index: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k position, token) pairs that chose `expert`, in the order eager's torch.where gives them."""
    # T tokens, K top-k: mask is (K, T), so rows come ordered by position, then token
    return torch.where((top_k_index == expert).transpose(0, 1))


def one_expert_view(module: torch.nn.Module, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The experts module seen as a module of one expert whose weights are a cache slot (views, no copies)."""
    view = copy.copy(module)  # shares act_fn, norms and settings; gets its own parameter table
    view._parameters = {name: p.unsqueeze(0) for name, p in params.items()}  # (1, ...) like (E, ...)
    view.num_experts = 1
    return view


def expert_contribution(
    module, params, hidden_states, top_k_index, top_k_weights, expert
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rows, weighted output rows) of one expert, computed by the eager forward on a one-expert view."""
    top_k_pos, token_idx = routed_rows(top_k_index, expert)
    rows = hidden_states[token_idx]  # (n, D)
    weights = top_k_weights[token_idx, top_k_pos].unsqueeze(-1)  # (n, 1)
    index = torch.zeros_like(weights, dtype=top_k_index.dtype)  # (n, 1): every row chose expert 0 of the view
    out = eager_forward_of(module)(one_expert_view(module, params), rows, index, weights)
    return token_idx, out


def combine(hidden_states: torch.Tensor, contributions: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum contributions in ascending expert order, as eager does, so timing never changes the result."""
    final = torch.zeros_like(hidden_states)
    for expert in sorted(contributions):
        token_idx, out = contributions[expert]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def timed_wait(cache, fetch, stats) -> int:
    start = time.perf_counter()
    expert = cache.wait(fetch)
    stats.io_wait_s += time.perf_counter() - start
    return expert
