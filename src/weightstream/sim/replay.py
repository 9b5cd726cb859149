"""Replay a routing trace through cache policies: the reference path (access_layer + policy objects, the
runtime's own code) and compiled fast paths that must decide exactly the same hits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightstream.cache.policies import ByteBudget, make_policy
from weightstream.cache.policy import access_layer, wave_positions
from weightstream.errors import WeightstreamError
from weightstream.sim import kernels
from weightstream.sim.belady import BeladyPolicy
from weightstream.sim.kernels_heap import belady_hits, lfu_hits
from weightstream.sim.miss_copy import SMALL_HIT, UPGRADE, MissCopy, calls_kinds, setting_name, small_bytes
from weightstream.sim.workload import Calls, Workload
from weightstream.trace import Trace

SIM_POLICIES = ("lru", "slru", "lfu", "pinned", "adaptive", "belady")


@dataclass(slots=True)
class MissCopyResult:
    """What `--miss-copy` would read at one upgrade setting, over the same judged lookups as exact mode: every miss
    reads a small copy (`ratio` of a blob), every upgrade a full blob; small hits read nothing."""

    upgrade_after: int | None  # None: never
    ratio: float
    small_reads: int  # = exact mode's misses
    upgrades: int
    small_hits: int  # hits computed with a small copy
    tokens: int
    bytes_read: int
    upgrades_per_layer: list[int]

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0

    def to_json(self, exact_bytes: int) -> dict:
        return {
            "upgrade_after": setting_name(self.upgrade_after),
            "ratio": self.ratio,
            "small_reads": self.small_reads,
            "upgrades": self.upgrades,
            "small_hits": self.small_hits,
            "bytes_per_token": self.bytes_per_token,
            "bytes_vs_exact": self.bytes_read / exact_bytes if exact_bytes else None,
        }


@dataclass(slots=True)
class Result:
    """What one policy at one cache size read over the judged part of a trace."""

    policy: str
    cache_bytes: int
    slots: int | None  # None under a byte budget (experts of different sizes)
    hits: int
    misses: int
    tokens: int
    bytes_read: int
    misses_per_layer: list[int]
    miss_copy: list[MissCopyResult] = field(default_factory=list)  # one per upgrade setting asked for

    @property
    def accesses(self) -> int:
        """Judged expert lookups."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Hits per judged lookup."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Expert bytes read per judged token."""
        return self.bytes_read / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        """The `simulate --json` record."""
        return {
            "policy": self.policy,
            "cache_bytes": self.cache_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "bytes_per_token": self.bytes_per_token,
            **({"miss_copy": [m.to_json(self.bytes_read) for m in self.miss_copy]} if self.miss_copy else {}),
        }


@dataclass(slots=True)
class Options:
    """Policy knobs: SLRU's protected share, adaptive's threshold, an explicit pinned set (else chosen)."""

    protected_share: float = 0.5
    threshold: float = 1.8
    pinned_keys: list[tuple[int, int]] | None = None

    def __post_init__(self):
        if not 0.0 <= self.protected_share <= 1.0:
            raise WeightstreamError(f"SLRU protected share must be within 0..1, got {self.protected_share}")
        if self.threshold <= 0:
            raise WeightstreamError(f"adaptive threshold must be a positive multiple, got {self.threshold}")


def _capacity(w: Workload, cache_bytes: int) -> int | None:
    """Slots for `cache_bytes`, or None when expert sizes differ and the budget is counted in bytes."""
    size = w.trace.shape.uniform_bytes
    if size is None:
        if cache_bytes < w.min_bytes:
            raise WeightstreamError(
                f"cache of {cache_bytes} bytes is below the {w.min_bytes} bytes one layer of one "
                f"step needs in this trace; use at least that"
            )
        return None
    slots = cache_bytes // size
    if slots < 1:
        raise WeightstreamError(
            f"cache of {cache_bytes} bytes holds no expert slot of {size} bytes; use at least "
            f"{size} bytes (one token's working set is {w.trace.shape.working_set_bytes})"
        )
    return slots


def _adaptive_inner(w: Workload, cache_bytes: int, slots: int | None, opts: Options) -> str:
    shape = w.trace.shape
    ratio = slots / shape.working_set_slots if slots is not None else cache_bytes / shape.working_set_bytes
    return "lru" if ratio < opts.threshold else "slru"


def pinned_set(w: Workload, slots: int, opts: Options) -> list[tuple[int, int]]:
    """The experts `pinned` keeps at `slots`: the given ones, else the most used that leave room for any group."""
    # Keep enough unpinned slots for the largest wave; the rest hold the training share's favourites.
    return opts.pinned_keys if opts.pinned_keys is not None else w.pinned_keys(slots - min(slots, w.min_slots))


def _fast_hits(w: Workload, name: str, slots: int, cache_bytes: int, opts: Options) -> np.ndarray:
    if name == "adaptive":
        name = _adaptive_inner(w, cache_bytes, slots, opts)
    if name == "lru":
        return w.lru_hits(slots)
    c = w.calls(slots)
    if name == "slru":
        hit = kernels.slru_hits(c.keys, c.offsets, w.n_keys, slots, int(slots * opts.protected_share))
    elif name == "lfu":
        hit = lfu_hits(c.keys, c.offsets, w.n_keys, slots)
    elif name == "belady":
        hit = belady_hits(c.keys, c.offsets, w.n_keys, slots, c.next_use)
    else:
        static = np.zeros(w.n_keys, np.uint8)
        layer_pos = {layer: i for i, layer in enumerate(w.trace.shape.layers)}
        for layer, expert in pinned_set(w, slots, opts):
            static[layer_pos[layer] * w.trace.shape.n_experts + expert] = 1
        hit = kernels.pinned_hits(c.keys, c.offsets, w.n_keys, slots, static)
    return c.in_trace_order(hit)


def build_policy(w: Workload, name: str, slots: int | None, cache_bytes: int, opts: Options):
    """The policy object the reference replay (and the runtime) uses, wrapped in a byte budget if needed."""
    shape = w.trace.shape
    capacity = slots if slots is not None else cache_bytes // min(shape.expert_bytes)
    if name == "belady":
        n_exp, layers = shape.n_experts, shape.layers
        c = w.group_calls if slots is None else w.calls(slots)  # the future in the order the lookups come
        access_keys = [(layers[k // n_exp], k % n_exp) for k in c.keys.tolist()]
        policy = BeladyPolicy(capacity, access_keys, c.next_use.tolist())
    elif name == "pinned":
        keys = opts.pinned_keys
        if keys is None:
            keys = (
                pinned_set(w, slots, opts)
                if slots is not None
                else w.pinned_keys(capacity, byte_limit=cache_bytes - w.min_bytes)
            )
        policy = make_policy("pinned", capacity, pinned_keys=keys)
    elif name == "adaptive" and slots is None:
        inner = _adaptive_inner(w, cache_bytes, slots, opts)
        policy = make_policy(inner, capacity, **({"protected_share": opts.protected_share} if inner == "slru" else {}))
    else:
        extra = {
            "slru": {"protected_share": opts.protected_share},
            "adaptive": {"threshold": opts.threshold, "protected_share": opts.protected_share},
        }.get(name, {})
        policy = make_policy(name, capacity, working_set_slots=shape.working_set_slots, **extra)
    if slots is None:
        policy = ByteBudget(policy, cache_bytes, dict(zip(shape.layers, shape.expert_bytes)))
    return policy


def _reference_hit_mask(w: Workload, policy) -> np.ndarray:
    """Every access's hit (True) or miss through access_layer, groups in order (in waves when a group outgrows the
    cache, as the runtime does: `wave_positions`); within a wave an expert listed again after its miss is a hit."""
    t = w.trace
    offsets, layers, experts = t.group_offsets.tolist(), t.group_layer.tolist(), t.experts.tolist()
    hit = np.ones(len(experts), bool)
    waves = not isinstance(policy, ByteBudget)  # byte budgets are refused below the largest group instead
    for g in range(len(layers)):
        a, b = offsets[g], offsets[g + 1]
        group = experts[a:b]
        for wave in wave_positions(group, policy.capacity) if waves else [range(b - a)]:
            missed = {e for _, e in access_layer(policy, layers[g], [group[i] for i in wave]).misses}
            for i in wave:
                if group[i] in missed:
                    hit[a + i] = False
                    missed.discard(group[i])
    return hit


def access_hits(w: Workload, name: str, cache_bytes: int, opts: Options | None = None) -> np.ndarray:
    """Hit (True) or miss of every access of `w` (warm-up part included) for one policy at one size.

    The fast path where experts have one size, else the reference path; both decide what `run_one` counts.
    """
    opts = opts or Options()
    if name not in SIM_POLICIES:
        raise WeightstreamError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
    slots = _capacity(w, int(cache_bytes))
    if slots is not None:
        return _fast_hits(w, name, slots, int(cache_bytes), opts).astype(bool)
    return _reference_hit_mask(w, build_policy(w, name, slots, int(cache_bytes), opts))


def access_calls(w: Workload, cache_bytes: int) -> Calls:
    """The lookup calls (`access_layer`; the engine's `fetch_layer`) a cache of `cache_bytes` makes: the layer groups,
    cut into waves where one outgrows the slots (a byte budget is refused below the largest group instead, so its
    calls are the groups)."""
    slots = _capacity(w, int(cache_bytes))
    return w.group_calls if slots is None else w.calls(slots)


def miss_copy_results(
    w: Workload, hit: np.ndarray, calls: Calls, miss_copy: MissCopy, misses_per_layer: np.ndarray
) -> list[MissCopyResult]:
    """`--miss-copy` at each upgrade setting from one replay's hit mask (every access, warm-up part included: a small
    copy read there can be hit in the judged part) and its calls; counts the judged part."""
    shape, out = w.trace.shape, []
    blob = np.asarray(shape.expert_bytes, np.int64)
    small_read = int(np.dot(misses_per_layer, small_bytes(miss_copy.ratio, shape.expert_bytes)))
    for n in miss_copy.upgrade_after:
        kind = calls_kinds(calls, hit, w.n_keys, n)[w.count_from :]
        upgrades = np.bincount(w.layer_pos[kind == UPGRADE], minlength=len(shape.layers))
        out.append(
            MissCopyResult(
                n,
                miss_copy.ratio,
                int(misses_per_layer.sum()),
                int(upgrades.sum()),
                int((kind == SMALL_HIT).sum()),
                w.judged_tokens,
                small_read + int(np.dot(upgrades, blob)),
                upgrades.tolist(),
            )
        )
    return out


def run_one(
    w: Workload,
    name: str,
    cache_bytes: int,
    opts: Options | None = None,
    method: str = "auto",
    miss_copy: MissCopy | None = None,
) -> Result:
    """One policy at one size over the judged part of `w`; with `miss_copy`, also what `--miss-copy` reads at each of
    its upgrade settings (the policy decides the same hits: a small copy fills a whole slot and its hits are hits)."""
    opts = opts or Options()
    if name not in SIM_POLICIES:
        raise WeightstreamError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
    slots = _capacity(w, int(cache_bytes))
    if method not in ("auto", "fast", "reference"):
        raise WeightstreamError(f"method must be auto, fast or reference, not {method!r}")
    if method == "fast" and slots is None:
        raise WeightstreamError("the fast path needs experts of one size; use method='reference' for byte budgets")
    if method != "reference" and slots is not None:
        hit_all = _fast_hits(w, name, slots, int(cache_bytes), opts).astype(bool)
    else:
        hit_all = _reference_hit_mask(w, build_policy(w, name, slots, int(cache_bytes), opts))
    hit = hit_all[w.count_from :]
    per_layer = np.bincount(w.layer_pos[~hit], minlength=len(w.trace.shape.layers))
    bytes_read = int(np.dot(per_layer, np.asarray(w.trace.shape.expert_bytes, np.int64)))
    result = Result(
        name,
        int(cache_bytes),
        slots,
        int(hit.sum()),
        int(per_layer.sum()),
        w.judged_tokens,
        bytes_read,
        per_layer.tolist(),
    )
    if miss_copy is not None:
        calls = access_calls(w, int(cache_bytes))
        result.miss_copy = miss_copy_results(w, hit_all, calls, miss_copy, per_layer)
    return result


def replay(
    trace: Trace,
    policy_name: str,
    cache_bytes: int,
    *,
    train_share: float = 0.0,
    method: str = "auto",
    miss_copy: MissCopy | None = None,
    **opts,
) -> Result:
    """Replay `trace` through one policy with access_layer semantics (steps in order, layers ascending); `miss_copy`
    adds what `--miss-copy` reads (`Result.miss_copy`)."""
    return run_one(Workload(trace, train_share), policy_name, cache_bytes, Options(**opts), method, miss_copy)


def simulate(
    trace: Trace,
    policies: Sequence[str],
    sizes: Sequence[int],
    *,
    train_share: float = 0.0,
    method: str = "auto",
    on_result: Callable[[Result], None] | None = None,
    miss_copy: MissCopy | None = None,
    **opts,
) -> list[Result]:
    """Every policy at every size (bytes); one workload is shared so LRU's distances are computed once."""
    w, options, results = Workload(trace, train_share), Options(**opts), []
    for name in policies:
        for size in sizes:
            results.append(run_one(w, name, size, options, method, miss_copy))
            if on_result:
                on_result(results[-1])
    return results
