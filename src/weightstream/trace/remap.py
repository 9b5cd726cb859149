"""A trace replayed on another model's shape, as the engine's routing replay does it, optionally re-cut into steps.

The engine (`engine.routing.RoutingReplay`) replays a trace token by token: model routed layer i takes trace routed
layer i (wrapping when the model has more layers), tokens in trace order, wrapping at the end, each forward pass
taking as many tokens as it computes. `onto_shape` builds the trace that replay produces, so the simulator judges
the lookups the engine will make.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightstream.errors import WeightstreamError
from weightstream.trace.format import PHASES, Trace
from weightstream.trace.shapes import ModelShape

Step = tuple[str, str, int]  # (request name, phase, tokens)


def token_rows(trace: Trace) -> np.ndarray:
    """[tokens, routed layers, top_k] expert ids in replay order, -1 where a token skipped a layer."""
    k, n_layers = trace.shape.top_k, len(trace.shape.layers)
    out = np.full((trace.n_tokens, n_layers, k), -1, dtype=np.int64)
    group_step = np.repeat(np.arange(trace.n_steps), np.diff(trace.step_groups))
    token_start = np.concatenate([[0], np.cumsum(trace.step_tokens)[:-1]]).astype(np.int64)
    gid = np.repeat(np.arange(len(trace.group_layer)), np.diff(trace.group_offsets))
    within = np.arange(trace.n_accesses) - trace.group_offsets[gid]
    pos = np.searchsorted(np.asarray(trace.shape.layers), trace.group_layer)
    out[token_start[group_step[gid]] + within // k, pos[gid], within % k] = trace.experts
    return out


def trace_steps(trace: Trace) -> list[Step]:
    """The trace's own steps as (request, phase, tokens)."""
    return [
        (trace.requests[r], PHASES[p], int(n))
        for r, p, n in zip(trace.step_request.tolist(), trace.step_phase.tolist(), trace.step_tokens.tolist())
    ]


def onto_shape(trace: Trace, shape: ModelShape, steps: Sequence[Step] | None = None) -> Trace:
    """`trace` as the engine replays it on a model of `shape` (its layers, experts and expert bytes; the trace's
    top-k), cut into `steps` (default: the trace's own), rows drawn in order and wrapping.

    Tokens that skipped a routed layer (a few in the Mixtral dump) are left out: the engine cannot replay them.
    """
    if trace.shape.n_experts > shape.n_experts:
        raise WeightstreamError(
            f"routing trace {trace.shape.name!r} has {trace.shape.n_experts} experts per layer; this model has "
            f"{shape.n_experts}; replay it on a model with at least as many"
        )
    layer_src = np.arange(len(shape.layers)) % len(trace.shape.layers)
    rows = token_rows(trace)[:, layer_src]  # [tokens, model layers, k]
    complete = (rows >= 0).all(axis=(1, 2))  # a token that skipped a layer cannot be replayed: left out
    if steps is None:  # the trace's own steps, less those with an incomplete token
        starts = np.concatenate([[0], np.cumsum(trace.step_tokens)[:-1]]).astype(np.int64)
        keep = np.minimum.reduceat(complete, starts) if len(starts) else np.zeros(0, bool)
        steps = [step for step, kept in zip(trace_steps(trace), keep.tolist()) if kept]
        complete &= np.repeat(keep, trace.step_tokens)
    rows = rows[complete]
    if not len(rows) or not steps:
        raise WeightstreamError(f"routing trace {trace.shape.name!r} has no token with a choice at every layer")
    total = sum(n for _, _, n in steps)
    chosen = rows[np.arange(total) % len(rows)]
    return _build(shape, trace.shape.top_k, steps, chosen)


def _build(shape: ModelShape, top_k: int, steps: list[Step], chosen: np.ndarray) -> Trace:
    n_model = len(shape.layers)
    request_ids: dict[str, int] = {}
    for r, _, _ in steps:
        request_ids.setdefault(r, len(request_ids))
    tokens = np.asarray([n for _, _, n in steps], np.int32)
    # per step, layer-major: each layer lists its tokens' choices one token after another
    parts = []
    start = 0
    for n in tokens.tolist():
        parts.append(chosen[start : start + n].transpose(1, 0, 2).reshape(-1))
        start += n
    group_sizes = np.repeat(tokens.astype(np.int64) * top_k, n_model)
    out = Trace(
        ModelShape(f"{shape.name} <- replay", list(shape.layers), shape.n_experts, top_k, list(shape.expert_bytes)),
        list(request_ids),
        np.asarray([request_ids[r] for r, _, _ in steps], np.int32),
        np.asarray([PHASES.index(p) for _, p, _ in steps], np.uint8),
        tokens,
        np.arange(0, (len(steps) + 1) * n_model, n_model, dtype=np.int64),
        np.tile(np.asarray(shape.layers, np.int32), len(steps)),
        np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64),
        np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32),
    )
    out.validate("replayed trace")
    return out
