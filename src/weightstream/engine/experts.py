"""The `weightstream` experts implementation for transformers, and the per-layer step it runs.

Per layer, routing bookkeeping is done once (which rows chose which expert, with which weight, in the order
eager's `torch.where` lists them); then each expert costs only its kernel call, on views of its cache slot:
resident experts first, each missing one as soon as its own bytes are in. Contributions are added into the
output in ascending expert order, as eager adds them, so the result never depends on read timing.

Under `--miss-copy` an expert whose slot holds its small copy (`ExpertSource.holds_small_copy`) is computed by the
kernel's `small` (the small copy's own block types): expert by expert each picks its kernel, and the one-call layer
computes each group of experts that hold the same copy, adding contributions as it always does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from weightstream import native
from weightstream.cache.expert_cache import ExpertSource
from weightstream.engine.kernels.eager import Kernel

IMPLEMENTATION = "weightstream"


def weightstream_experts_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Drop-in for the experts forward: (hidden_states, top_k_index, top_k_weights) -> combined expert output;
    `self` is the experts module, which the loader gave its runtime (`_ws_runtime`)."""
    top_k_index, top_k_weights = (list(args) + list(kwargs.values()))[:2]
    return self._ws_runtime.experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, weightstream_experts_forward)


class LayerRouting:
    """One layer's routing, sorted by expert once: each expert's token rows and weights are then slices."""

    def __init__(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # T tokens, K top-k. Eager visits (k, t) pairs k-major (torch.where over a (K, T) mask); a stable sort
        # by expert keeps that order within each expert.
        tokens = top_k_index.shape[0]
        chosen = top_k_index.t().reshape(-1)  # (K*T,)
        order = torch.argsort(chosen, stable=True)
        self.token_idx = order % tokens  # (K*T,) token of each pair, grouped by expert
        self.weights = top_k_weights.t().reshape(-1)[order].unsqueeze(-1)  # (K*T, 1) = top_k_weights[t, k]
        experts, counts = torch.unique_consecutive(chosen[order], return_counts=True)
        self.span: dict[int, tuple[int, int]] = {}
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist()):
            self.span[expert] = (start, start + count)
            start += count

    def rows(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices, router weights (n, 1)) of the rows that chose `expert`."""
        start, end = self.span[expert]
        return self.token_idx[start:end], self.weights[start:end]


class OrderedSum:
    """Adds contributions into `out` in ascending expert order as they become available, holding only the early."""

    def __init__(self, out: torch.Tensor, experts):
        self.out, self.order, self.next = out, sorted(experts), 0
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, expert: int, token_idx: torch.Tensor, rows_out: torch.Tensor) -> None:
        self.pending[expert] = (token_idx, rows_out)
        while self.next < len(self.order) and self.order[self.next] in self.pending:
            token_idx, rows_out = self.pending.pop(self.order[self.next])
            self.out.index_add_(0, token_idx, rows_out.to(self.out.dtype))
            self.next += 1


def arrivals(
    source: ExpertSource,
    layer: int,
    waves: list[list[int]],
    io_wait: Callable[[float], None],
    after_first_fetch: Callable[[list[int]], None] | None = None,
):
    """The layer's experts in the order they can be computed, as (group, last) pairs: each wave looked up, its
    resident experts first (computed while its misses are read), then each missing one as soon as its own bytes are
    in; `last` says no group follows. The wave's pins hold until the next wave is looked up."""
    for i, wave in enumerate(waves):
        fetch = source.fetch_layer(layer, wave)
        if i == 0 and after_first_fetch is not None:  # e.g. read-ahead: queued after this layer's demand reads
            after_first_fetch(wave)
        final_wave = i == len(waves) - 1
        yield fetch.resident, final_wave and not fetch.missing
        for n in range(len(fetch.missing)):
            start = time.perf_counter()
            expert = source.wait(fetch)
            io_wait(time.perf_counter() - start)
            yield [expert], final_wave and n == len(fetch.missing) - 1


def compute_layer(
    kernel: Kernel,
    source: ExpertSource,
    layer: int,
    hidden_states: torch.Tensor,
    routing: LayerRouting,
    waves: list[list[int]],
    io_wait: Callable[[float], None],
    after_first_fetch: Callable[[list[int]], None] | None = None,
) -> torch.Tensor:
    """The layer's combined expert output: each wave looked up, resident experts computed while misses load."""
    total = OrderedSum(torch.zeros_like(hidden_states), routing.span)
    for group, _ in arrivals(source, layer, waves, io_wait, after_first_fetch):  # each expert in one wave only
        for expert in group:
            token_idx, weights = routing.rows(expert)
            compute = _kernel_of(kernel, source, layer, expert)
            total.add(expert, token_idx, compute(hidden_states[token_idx], weights, source.params(layer, expert)))
    assert not total.pending and total.next == len(total.order), "an expert of the layer was never computed"
    return total.out


def compute_layer_native(
    kernel,
    source: ExpertSource,
    layer: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    waves: list[list[int]],
    io_wait: Callable[[float], None],
    after_first_fetch: Callable[[list[int]], None] | None = None,
) -> torch.Tensor:
    """`compute_layer` for a kernel that runs a whole layer natively (`QuantizedExperts.layer`): one call when every
    routed expert is resident (and holds the same copy); else each group (the resident ones, then each missing one
    as its bytes arrive; split by the copy they hold) fills its rows of the contributions, which are added in
    ascending expert order at the end, as the one call adds them, so the result is the same bitwise."""
    contrib = None
    done: set[int] = set()
    for group, last in arrivals(source, layer, waves, io_wait, after_first_fetch):
        parts = _by_kernel(kernel, source, layer, sorted(group))  # each expert in one wave only
        if contrib is None and last and len(parts) == 1:  # the whole layer, every routed expert resident
            compute, experts = parts[0]
            return compute.layer(hidden_states, top_k_index, top_k_weights, experts, _params(source, layer, experts))
        if contrib is None:
            contrib = empty_contributions(hidden_states, top_k_index)
        _contribute(contrib, parts, source, layer, hidden_states, top_k_index, top_k_weights, done)
    assert done == set(top_k_index.reshape(-1).tolist()), "an expert of the layer was never computed"
    return native.moe_sum(contrib, top_k_index, hidden_states)


def empty_contributions(hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """The contributions of a layer before any expert's: (tokens, top-k, hidden) float32 zeros, which
    `native.moe_sum` adds in ascending expert order."""
    return torch.zeros(*top_k_index.shape, hidden_states.shape[-1], dtype=torch.float32)


def contribute_groups(
    contrib: torch.Tensor,
    kernel,
    source: ExpertSource,
    layer: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    groups,
) -> set[int]:
    """Fills `contrib` with the rows of each group's experts (groups of experts as they can be computed, e.g. from
    `arrivals`, which lists each expert in one group), each group split by the copy its experts hold; returns the
    experts computed."""
    done: set[int] = set()
    for group in groups:
        parts = _by_kernel(kernel, source, layer, sorted(group))
        _contribute(contrib, parts, source, layer, hidden_states, top_k_index, top_k_weights, done)
    return done


def _contribute(contrib, parts, source, layer, hidden_states, top_k_index, top_k_weights, done: set[int]) -> None:
    """Each (kernel, experts) of `parts` fills its experts' rows of `contrib`; they join `done`."""
    for compute, members in parts:
        done.update(members)
        compute.contribute(contrib, hidden_states, top_k_index, top_k_weights, members, _params(source, layer, members))


def _params(source: ExpertSource, layer: int, experts: list[int]) -> list:
    return [source.params(layer, e) for e in experts]


def _kernel_of(kernel, source: ExpertSource, layer: int, expert: int):
    """The kernel of the copy the expert's slot holds: the small copies' (`kernel.small`) or the kernel itself."""
    small = getattr(kernel, "small", None)  # a QuantizedExperts' (None without --miss-copy); eager kernels have none
    return small if small is not None and source.holds_small_copy(layer, expert) else kernel


def _by_kernel(kernel, source: ExpertSource, layer: int, experts: list[int]) -> list[tuple[object, list[int]]]:
    """`experts` (ascending) in groups by the kernel of the copy each holds, [(kernel, its experts)]: one group
    without --miss-copy, none for no experts."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for e in experts:
        compute = _kernel_of(kernel, source, layer, e)
        groups.setdefault(id(compute), (compute, []))[1].append(e)
    return list(groups.values())
