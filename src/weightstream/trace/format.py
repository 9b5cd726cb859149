"""The routing trace held in memory: flat integer arrays plus offsets, and a builder engines append to.

Layout (see docs/trace-format.md): steps -> groups (one per routed layer the step reached, layers ascending)
-> accesses (chosen experts in router order; a batched step lists its tokens' choices one token after another).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightstream.errors import WeightstreamError
from weightstream.trace.shapes import ModelShape

PHASES = ("prefill", "decode")


@dataclass
class Trace:
    """Recorded router decisions of one or more requests on one model shape."""

    shape: ModelShape
    requests: list[str]  # request names, index = request id
    step_request: np.ndarray  # int32 [S]   request id of each step
    step_phase: np.ndarray  # uint8 [S]   index into PHASES
    step_tokens: np.ndarray  # int32 [S]   tokens the step computes (1 unless a batched prefill)
    step_groups: np.ndarray  # int64 [S+1] offsets into the group arrays
    group_layer: np.ndarray  # int32 [G]   model layer index of each group
    group_offsets: np.ndarray  # int64 [G+1] offsets into experts
    experts: np.ndarray  # int32 [A]   chosen expert ids
    weights: np.ndarray | None = None  # float32 [A] router weights, when known

    @property
    def n_steps(self) -> int:
        """Number of steps (forward passes)."""
        return len(self.step_request)

    @property
    def n_tokens(self) -> int:
        """Tokens over all steps."""
        return int(self.step_tokens.sum())

    @property
    def n_accesses(self) -> int:
        """Expert lookups the replay makes: one per (token, routed layer, chosen expert)."""
        return len(self.experts)

    def access_range(self, first_step: int, end_step: int) -> tuple[int, int]:
        """[start, end) of the accesses that belong to steps [first_step, end_step)."""
        g0, g1 = self.step_groups[first_step], self.step_groups[end_step]
        return int(self.group_offsets[g0]), int(self.group_offsets[g1])

    def first_step_of_request(self, request: int) -> int:
        """Index of the first step at or after request id `request` in replay order (n_steps if none)."""
        hit = np.flatnonzero(self.step_request >= request)
        return int(hit[0]) if len(hit) else self.n_steps

    def slice_steps(self, first_step: int, end_step: int) -> Trace:
        """A trace of steps [first_step, end_step) only, keeping just the requests those steps belong to."""
        g0, g1 = int(self.step_groups[first_step]), int(self.step_groups[end_step])
        a0, a1 = self.access_range(first_step, end_step)
        cut = slice(first_step, end_step)
        kept, first_seen = np.unique(self.step_request[cut], return_index=True)
        kept = kept[np.argsort(first_seen)]  # request ids stay in order of first appearance
        remap = np.zeros(len(self.requests), np.int32)
        remap[kept] = np.arange(len(kept), dtype=np.int32)
        return Trace(
            self.shape,
            [self.requests[r] for r in kept.tolist()],
            remap[self.step_request[cut]],
            self.step_phase[cut].copy(),
            self.step_tokens[cut].copy(),
            self.step_groups[first_step : end_step + 1] - g0,
            self.group_layer[g0:g1].copy(),
            self.group_offsets[g0 : g1 + 1] - a0,
            self.experts[a0:a1].copy(),
            None if self.weights is None else self.weights[a0:a1].copy(),
        )

    def key_index(self) -> np.ndarray:
        """Dense key id per access, position-of-layer * n_experts + expert (what the fast simulator uses)."""
        pos = np.searchsorted(np.asarray(self.shape.layers), self.group_layer).astype(np.int64)
        per_access = np.repeat(pos, np.diff(self.group_offsets))
        return (per_access * self.shape.n_experts + self.experts).astype(np.int32)

    def validate(self, source: str = "trace") -> None:
        """Raise WeightstreamError naming `source` and the step if the arrays are inconsistent or out of shape."""
        _check_offsets(self.step_groups, len(self.group_layer), source, "step")
        _check_offsets(self.group_offsets, len(self.experts), source, "layer group")
        n = self.n_steps
        if not (len(self.step_phase) == len(self.step_tokens) == n) or (
            n and self.step_request.max() >= len(self.requests)
        ):
            raise WeightstreamError(f"{source}: per-step arrays disagree in length or name unknown requests")
        if self.weights is not None and len(self.weights) != len(self.experts):
            raise WeightstreamError(f"{source}: {len(self.weights)} router weights for {len(self.experts)} experts")
        if n and (self.step_phase.max() >= len(PHASES) or self.step_tokens.min() < 1):
            raise WeightstreamError(f"{source}: a step has an unknown phase or fewer than one token")
        _check_layers(self, source)
        _check_group_sizes(self, source)
        bad = np.flatnonzero((self.experts < 0) | (self.experts >= self.shape.n_experts))
        if len(bad):
            step, group = _locate(self, int(bad[0]))
            raise WeightstreamError(
                f"{source}: step {step} layer {self.group_layer[group]}: expert {self.experts[bad[0]]} is outside "
                f"0..{self.shape.n_experts - 1} of shape {self.shape.name!r}; was the trace made for another model?"
            )


def _check_offsets(offsets: np.ndarray, total: int, source: str, what: str) -> None:
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
        raise WeightstreamError(f"{source}: {what} offsets are not a monotonic 0..{total} index; the file is damaged")


def _check_layers(trace: Trace, source: str) -> None:
    layers = np.asarray(trace.shape.layers)
    known = np.isin(trace.group_layer, layers)
    if not known.all():
        g = int(np.flatnonzero(~known)[0])
        step = int(np.searchsorted(trace.step_groups, g, side="right") - 1)
        raise WeightstreamError(
            f"{source}: step {step} lists layer {trace.group_layer[g]}, but shape {trace.shape.name!r} routes only "
            f"in layers {layers[0]}..{layers[-1]} ({len(layers)} layers); pass the shape of the model that made it"
        )
    # Within a step, layers strictly ascend: the replay order is layers ascending, one group per layer.
    ascending = np.diff(trace.group_layer) > 0
    starts = np.zeros(len(trace.group_layer), bool)
    starts[trace.step_groups[:-1][trace.step_groups[:-1] < len(starts)]] = True
    bad = np.flatnonzero(~ascending & ~starts[1:])
    if len(bad):
        step = int(np.searchsorted(trace.step_groups, bad[0] + 1, side="right") - 1)
        raise WeightstreamError(
            f"{source}: step {step} lists layer {trace.group_layer[bad[0] + 1]} after layer "
            f"{trace.group_layer[bad[0]]}; layers must ascend within a step"
        )
    if len(trace.group_offsets) > 1 and np.any(np.diff(trace.group_offsets) == 0):
        g = int(np.flatnonzero(np.diff(trace.group_offsets) == 0)[0])
        raise WeightstreamError(f"{source}: layer group {g} (layer {trace.group_layer[g]}) chose no experts")


def _check_group_sizes(trace: Trace, source: str) -> None:
    """Every layer group lists top-k experts for each of its step's tokens (replay reshapes it to tokens x top-k)."""
    tokens_of_group = np.repeat(trace.step_tokens.astype(np.int64), np.diff(trace.step_groups))
    sizes = np.diff(trace.group_offsets)
    bad = np.flatnonzero(sizes != tokens_of_group * trace.shape.top_k)
    if len(bad):
        g = int(bad[0])
        step = int(np.searchsorted(trace.step_groups, g, side="right") - 1)
        raise WeightstreamError(
            f"{source}: step {step} layer {trace.group_layer[g]} lists {sizes[g]} expert choices; its "
            f"{tokens_of_group[g]} token(s) x top-{trace.shape.top_k} of shape {trace.shape.name!r} make "
            f"{tokens_of_group[g] * trace.shape.top_k}; was the trace made with another top-k or token count?"
        )


def _locate(trace: Trace, access: int) -> tuple[int, int]:
    group = int(np.searchsorted(trace.group_offsets, access, side="right") - 1)
    return int(np.searchsorted(trace.step_groups, group, side="right") - 1), group


class TraceWriter:
    """Build a Trace step by step: ``begin_step(request, phase)`` then ``add(layer, experts, weights)`` per layer."""

    def __init__(self, shape: ModelShape, source: str = "trace"):
        self.shape, self.source = shape, source
        self._layers = set(shape.layers)
        self._request_ids: dict[str, int] = {}
        self._steps: list[tuple[int, int, int]] = []  # (request id, phase index, tokens or 0 = infer)
        self._step_groups = [0]
        self._group_layer: list[int] = []
        self._group_offsets = [0]
        self._experts: list[int] = []
        self._weights: list[float] = []
        self._has_weights: bool | None = None

    def begin_step(self, request: str | int, phase: str, n_tokens: int | None = None) -> None:
        """Start a step (one forward pass) of `request`; `n_tokens` defaults to what the added choices imply."""
        if phase not in PHASES:
            raise WeightstreamError(f"{self.source}: phase {phase!r} is not one of {PHASES}")
        self._close_step()
        rid = self._request_ids.setdefault(str(request), len(self._request_ids))
        self._steps.append((rid, PHASES.index(phase), int(n_tokens or 0)))

    def add(self, layer: int, experts, weights=None) -> None:
        """Record a layer's chosen experts in router order (several tokens' choices concatenated in token order)."""
        if not self._steps:
            raise WeightstreamError(f"{self.source}: add() before begin_step()")
        experts = [int(e) for e in experts]
        where = f"{self.source}: step {len(self._steps) - 1} layer {layer}"
        if layer not in self._layers:
            raise WeightstreamError(
                f"{where}: layer is not a routed layer of shape {self.shape.name!r} "
                f"({self.shape.layers[0]}..{self.shape.layers[-1]})"
            )
        if not experts or min(experts) < 0 or max(experts) >= self.shape.n_experts:
            raise WeightstreamError(
                f"{where}: experts {experts} must be non-empty ids in 0..{self.shape.n_experts - 1}"
            )
        self._add_weights(where, weights, len(experts))
        open_groups = len(self._group_layer) - self._step_groups[-1]
        last = self._group_layer[-1] if open_groups else None
        if last is not None and layer < last:
            raise WeightstreamError(f"{where}: added after layer {last}; layers must ascend within a step")
        if last != layer:
            self._group_layer.append(int(layer))
            self._group_offsets.append(self._group_offsets[-1])
        self._experts.extend(experts)
        self._group_offsets[-1] += len(experts)

    def _add_weights(self, where: str, weights, n: int) -> None:
        has = weights is not None
        if self._has_weights is None:
            self._has_weights = has
        if has != self._has_weights:
            raise WeightstreamError(f"{where}: router weights given for some layers and not others")
        if has:
            weights = [float(w) for w in weights]
            if len(weights) != n:
                raise WeightstreamError(f"{where}: {len(weights)} weights for {n} experts")
            self._weights.extend(weights)

    def _close_step(self) -> None:
        if not self._steps:
            return
        if len(self._group_layer) == self._step_groups[-1]:
            raise WeightstreamError(f"{self.source}: step {len(self._steps) - 1} recorded no layer")
        rid, phase, tokens = self._steps[-1]
        if tokens == 0:  # infer: the longest layer list holds top_k choices per token
            first = self._step_groups[-1]
            longest = max(
                self._group_offsets[g + 1] - self._group_offsets[g] for g in range(first, len(self._group_layer))
            )
            self._steps[-1] = (rid, phase, -(-longest // self.shape.top_k))
        self._step_groups.append(len(self._group_layer))

    def finish(self) -> Trace:
        """Close the last step and return the Trace."""
        self._close_step()
        if not self._steps:
            raise WeightstreamError(f"{self.source}: no steps recorded; the input holds no routing")
        steps = np.asarray(self._steps, dtype=np.int64).reshape(-1, 3)
        names = sorted(self._request_ids, key=self._request_ids.get)
        trace = Trace(
            self.shape,
            names,
            steps[:, 0].astype(np.int32),
            steps[:, 1].astype(np.uint8),
            steps[:, 2].astype(np.int32),
            np.asarray(self._step_groups, np.int64),
            np.asarray(self._group_layer, np.int32),
            np.asarray(self._group_offsets, np.int64),
            np.asarray(self._experts, np.int32),
            np.asarray(self._weights, np.float32) if self._has_weights else None,
        )
        trace.validate(self.source)
        return trace
