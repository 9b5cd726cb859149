"""A trace prepared for replay: dense keys, the judged window, and lazily computed per-trace facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from weightstream.errors import WeightstreamError
from weightstream.sim import kernels
from weightstream.sim.kernels_heap import next_use
from weightstream.trace import Trace


@dataclass(frozen=True, eq=False)
class Calls:
    """A cache's lookup calls over a trace: `keys` in the order they are looked up, `offsets` (int64 [C+1]) where each
    call starts in them, and `order` the trace index of each (None where that is the trace's own order). Within a
    layer group only: every per-group fact (layer, step) is the same in either order."""

    keys: np.ndarray
    offsets: np.ndarray
    order: np.ndarray | None

    def looked_up(self, per_access: np.ndarray) -> np.ndarray:
        """A per-access array in trace order, put in lookup order."""
        return per_access if self.order is None else per_access[self.order]

    def in_trace_order(self, per_access: np.ndarray) -> np.ndarray:
        """A per-access array in lookup order, put back in trace order."""
        if self.order is None:
            return per_access
        out = np.empty_like(per_access)
        out[self.order] = per_access
        return out

    @cached_property
    def next_use(self) -> np.ndarray:
        """Position (in lookup order) of each lookup's next of the same key."""
        return next_use(self.keys)


@dataclass
class Workload:
    """`trace` split into a warm-up part (first `train_share` of its requests) and a judged part."""

    trace: Trace
    train_share: float = 0.0
    count_from: int = field(init=False)  # first judged access
    judged_tokens: int = field(init=False)
    train_requests: int = field(init=False)
    _waves: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        n_req = len(self.trace.requests)
        if not 0.0 <= self.train_share < 1.0:
            raise WeightstreamError(f"train share must be in [0, 1), got {self.train_share}")
        self.train_requests = int(n_req * self.train_share)
        if self.train_share > 0 and not 1 <= self.train_requests < n_req:
            raise WeightstreamError(
                f"a train share of {self.train_share} of {n_req} request(s) leaves no training "
                f"or no judged request; use --train-share 0 or a trace with more requests"
            )
        first = self.trace.first_step_of_request(self.train_requests)
        self.count_from = self.trace.access_range(first, self.trace.n_steps)[0]
        self.judged_tokens = int(self.trace.step_tokens[first:].sum())

    @property
    def n_keys(self) -> int:
        """Dense key space: routed layers x experts."""
        return len(self.trace.shape.layers) * self.trace.shape.n_experts

    @cached_property
    def keys(self) -> np.ndarray:
        """Dense key id of every access in replay order."""
        return self.trace.key_index()

    @property
    def gstart(self) -> np.ndarray:
        """Access offset of every layer group (one access_layer call each when it fits the cache)."""
        return self.trace.group_offsets

    def calls(self, slots: int) -> Calls:
        """The access_layer calls a cache of `slots` makes: the groups, each cut into waves where it outgrows the
        slots (`kernels.wave_order`, the runtime's rule), with the keys in the order they are looked up."""
        if slots >= self.min_slots:
            return self.group_calls
        if slots not in self._waves:
            order, offsets = kernels.wave_order(self.keys, self.gstart, self.n_keys, slots)
            self._waves[slots] = Calls(self.keys[order], offsets, order)
        return self._waves[slots]

    def lru_hits(self, slots: int) -> np.ndarray:
        """LRU's hit mask at `slots`: one shared stack-distance pass serves every size that needs no waves."""
        if slots >= self.min_slots:
            return self.lru_distances < slots
        calls = self.calls(slots)
        return calls.in_trace_order(kernels.lru_distances(calls.keys, calls.offsets, self.n_keys) < slots)

    @cached_property
    def layer_pos(self) -> np.ndarray:
        """Position in shape.layers of each judged access."""
        return (self.keys[self.count_from :] // self.trace.shape.n_experts).astype(np.int64)

    @cached_property
    def lru_distances(self) -> np.ndarray:
        """Stack distances under group pinning (one pass serves every LRU size)."""
        return kernels.lru_distances(self.keys, self.gstart, self.n_keys)

    @cached_property
    def group_calls(self) -> Calls:
        """One access_layer call per layer group, in trace order (a cache that holds every group's experts)."""
        return Calls(self.keys, self.gstart, None)

    @property
    def next_use(self) -> np.ndarray:
        """Position of each access's next use of the same key."""
        return self.group_calls.next_use

    @cached_property
    def min_slots(self) -> int:
        """Distinct experts of the largest layer group: from this many slots on, no group is served in waves."""
        return int(kernels.largest_group(self.keys, self.gstart, self.n_keys))

    @cached_property
    def min_bytes(self) -> int:
        """Fewest bytes a byte-budget replay needs: the costliest layer group's distinct experts."""
        sizes = np.asarray(self.trace.shape.expert_bytes, np.int64)
        gid = np.repeat(np.arange(len(self.gstart) - 1), np.diff(self.gstart))
        pairs = np.unique(gid.astype(np.int64) * self.n_keys + self.keys)
        cost = np.bincount(pairs // self.n_keys, weights=sizes[(pairs % self.n_keys) // self.trace.shape.n_experts])
        return int(cost.max())

    def training_counts(self) -> np.ndarray:
        """Accesses per dense key in the training part (the whole trace when there is none)."""
        part = self.keys[: self.count_from] if self.count_from else self.keys
        return np.bincount(part, minlength=self.n_keys)

    def pinned_keys(self, n: int, byte_limit: int | None = None) -> list[tuple[int, int]]:
        """Up to `n` most used (layer, expert) keys of the training part, within `byte_limit` bytes if given.

        Ties go to the lower layer, then the lower expert; keys never used in training are not pinned.
        """
        counts = self.training_counts()
        order = np.lexsort((np.arange(self.n_keys), -counts))[: max(n, 0)]
        order = order[counts[order] > 0]
        shape = self.trace.shape
        if byte_limit is not None:
            sizes = np.asarray(shape.expert_bytes, np.int64)[order // shape.n_experts]
            order = order[np.cumsum(sizes) <= byte_limit]
        return [(shape.layers[k // shape.n_experts], int(k % shape.n_experts)) for k in order.tolist()]
