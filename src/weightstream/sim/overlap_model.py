"""Time per step from what the simulator says each layer misses, with reads overlapped with compute as the engine does.

The engine computes a layer's resident experts while the I/O threads read its misses, then each late expert as soon
as its own bytes land; a layer's reads are all awaited before the next layer. With n experts to compute in a layer,
m of them missing, c seconds of compute per expert, the first miss landing after `lat` and each further one `r`
later (r = read MiB per expert x seconds per MiB at the reader's bandwidth):

    layer(n, 0) = f + n c
    layer(n, m) = f + max(n c,  lat + m r + c,  lat + r + m c)

(all compute; the last read then its expert; the first read then every late expert back to back), f being the
MoE block's own seconds whatever the number of experts (lookups, token grouping, the call itself). Per step:

    expert cache:  T = dense(tokens) + sum over layers of layer(n, m)  + g x MiB missed
    page cache:    T = dense(tokens) + sum over layers of (f + n c)    + p x MiB missed

where g is the reads' cost that does not overlap (I/O threads' CPU, packs), p the page cache's cost per missed MiB
(mmap faults stall the computing thread, no overlap), dense(tokens) = dense_s + (tokens - 1) dense_per_token_s and
c = expert_call_s + rows per expert x expert_row_s. `docs/tune.md` derives it and says how each term is measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from weightstream.sim.cost_model import CostModel, fit_line


@dataclass(slots=True)
class CostParams:
    """Calibrated seconds for one model on one machine at one I/O setting."""

    dense_s: float  # per decode step, outside the experts: attention, norms, routers, lm_head, the loop
    dense_per_token_s: float  # extra dense seconds per further token of a batched (prefill) step
    expert_call_s: float  # per expert computed in a layer
    expert_row_s: float  # per token row through one expert
    read_latency_s: float  # from queueing a layer's misses to the first one landing
    read_s_per_mib: float  # 1 / the reader's bandwidth at the engine's I/O threads
    nonoverlap_s_per_mib: float = 0.0
    page_cache_s_per_mib: float | None = None
    page_cached_per_byte: float = 1.0  # page cache taken per expert byte faulted in (readahead around faults)
    layer_fixed_s: float = 0.0  # per MoE layer that computes any expert, whatever their number
    # a page cache at its limit: seconds per MiB the kernel reads (/proc/self/io; older calibrations: bytes touched x
    # readahead) where each read first reclaims; None where calibration could not measure it (the cold figure serves)
    page_limit_s_per_mib: float | None = None
    # [bytes the kernel reads ahead of, past] each span of an expert faulted in alone; None: not measured (then the
    # page-cache model shares page_cached_per_byte's extra among the spans)
    page_readahead: list[list[int]] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostParams:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(slots=True)
class StepLoad:
    """What each step makes a cache do, from the simulator: experts computed and missed per (step, layer)."""

    tokens: np.ndarray  # [S] tokens each step computes
    distinct: np.ndarray  # [S, L] distinct experts computed per layer
    misses: np.ndarray  # [S, L] of those, missed
    top_k: int  # choices per token per layer

    def rows_per_expert(self) -> np.ndarray:
        """[S, L] mean token rows through each computed expert."""
        return self.tokens[:, None] * self.top_k / np.maximum(self.distinct, 1)


def layer_seconds(n, m, c, latency: float, r) -> np.ndarray:
    """One layer's time: n experts of c seconds each, m of them read (first after `latency`, then one per r)."""
    n, m, c, r = (np.asarray(x, float) for x in (n, m, c, r))
    overlapped = np.maximum.reduce([n * c, latency + m * r + c, latency + r + m * c])
    return np.where(m > 0, overlapped, n * c)


def dense_seconds(p: CostParams, tokens: np.ndarray) -> np.ndarray:
    return p.dense_s + (np.asarray(tokens, float) - 1) * p.dense_per_token_s


def expert_cache_step_s(p: CostParams, load: StepLoad, read_mib_per_expert: float | np.ndarray) -> np.ndarray:
    """[S] predicted seconds of each step through the expert cache. `read_mib_per_expert`: one figure, or [S, L] the
    mean MiB of each layer's reads where they differ (`--miss-copy`: small copies and full blobs), whose sum is then
    what the layer's last read waits for."""
    c = p.expert_call_s + load.rows_per_expert() * p.expert_row_s
    r = read_mib_per_expert * p.read_s_per_mib
    layers = layer_seconds(load.distinct, load.misses, c, p.read_latency_s, r).sum(axis=1) + _fixed(p, load)
    return dense_seconds(p, load.tokens) + layers + p.nonoverlap_s_per_mib * _missed_mib(load, read_mib_per_expert)


def _missed_mib(load: StepLoad, read_mib_per_expert: float | np.ndarray) -> np.ndarray:
    """[S] MiB each step reads."""
    if np.ndim(read_mib_per_expert) == 0:
        return load.misses.sum(axis=1) * read_mib_per_expert
    return (load.misses * read_mib_per_expert).sum(axis=1)


def page_cache_step_s(p: CostParams, load: StepLoad, mib_per_expert: float) -> np.ndarray:
    """[S] predicted seconds of each step through mmap and the page cache (faults are not overlapped)."""
    if p.page_cache_s_per_mib is None:
        raise ValueError("no page-cache calibration")
    c = p.expert_call_s + load.rows_per_expert() * p.expert_row_s
    compute = (load.distinct * c).sum(axis=1) + _fixed(p, load)
    return dense_seconds(p, load.tokens) + compute + p.page_cache_s_per_mib * load.misses.sum(axis=1) * mib_per_expert


def _fixed(p: CostParams, load: StepLoad) -> np.ndarray:
    """[S] the MoE blocks' fixed seconds: one per layer that computes any expert."""
    return p.layer_fixed_s * (load.distinct > 0).sum(axis=1)


def linear_step_s(model: CostModel, load: StepLoad, read_mib_per_expert: float | np.ndarray) -> np.ndarray:
    """[S] the fallback: bench's fitted line, fixed + per MiB read (fitted on decode steps only)."""
    return model.predict_s_per_token(_missed_mib(load, read_mib_per_expert))


@dataclass(slots=True)
class Measurements:
    """Raw calibration timings (medians, seconds) that `fit_cost_params` turns into CostParams."""

    layers: int
    top_k: int
    decode_step_s: float  # compute only: every expert resident
    decode_expert_s: float  # of which inside the experts
    decode_one_expert_s: float  # inside the experts, compute only, with one expert per layer instead of top-k
    prefill_tokens: int
    prefill_step_s: float  # compute only, every token choosing the same top-k experts
    prefill_expert_s: float
    read_batches: list[int]  # experts per batch queued at once
    read_seconds: list[float]  # time until each batch had landed
    read_mib_per_expert: float
    miss_step_s: float  # every chosen expert missing (a fresh set each step), through the expert cache
    miss_per_layer: float  # misses per layer per step in that run
    # the same with only some of each layer's top-k missing (the rest resident), one entry per level timed: the
    # regime of a cache that mostly hits, where one all-miss figure alone mis-prices the reads' non-overlapped cost
    partial_miss_step_s: list[float] = field(default_factory=list)
    partial_miss_per_layer: list[float] = field(default_factory=list)
    page_step_s: float | None = None  # every chosen expert missing, through mmap, cold
    page_missed_mib: float | None = None  # MiB faulted in per step there
    page_cached_per_byte: float | None = None  # page cache filled per expert byte touched there
    page_limit_step_s: float | None = None  # the same through mmap in a cgroup full from the first layer on
    page_limit_evicted_mib: float | None = None  # MiB the kernel read per step there, each after a reclaim
    page_readahead: list[list[int]] | None = None  # [ahead, past] bytes around each span of a lone expert's fault

    def to_dict(self) -> dict:
        return asdict(self)


def fit_read_line(batches: list[int], seconds: list[float]) -> tuple[float, float]:
    """(latency, seconds per expert) of t = latency + experts x per expert, least squares, neither below 0
    (`cost_model.fit_line`: a negative latency is noise, and the line is then refitted through the origin)."""
    line = fit_line(batches, seconds)
    if line is None:
        raise ValueError("the read line needs batches of at least two sizes")
    return line


def fit_cost_params(m: Measurements) -> CostParams:
    """Solve the model's terms from the calibration runs (each clamped at 0: timing noise is not a negative cost)."""
    # a layer's experts cost f + n c: top-k of them against one gives c (one call, one row) and f
    per_layer, per_layer_one = m.decode_expert_s / m.layers, m.decode_one_expert_s / m.layers
    per_expert = max((per_layer - per_layer_one) / max(m.top_k - 1, 1), 0.0)
    fixed = max(per_layer_one - per_expert, 0.0)
    per_expert_prefill = (m.prefill_expert_s / m.layers - fixed) / m.top_k  # one call with `prefill_tokens` rows
    # at most c1, so that expert_call_s + expert_row_s = c1 still holds: native kernels run 32 rows by another route
    # (multi-row tiles, or the weight dequantized once: NATIVE_DEQUANT_ROWS) whose first row costs more than a whole
    # one-row expert, and a line through both would price a decode expert at that row cost (0.33 ms where it took
    # 0.17)
    row = min(max((per_expert_prefill - per_expert) / max(m.prefill_tokens - 1, 1), 0.0), per_expert)
    dense = max(m.decode_step_s - m.decode_expert_s, 0.0)
    dense_prefill = m.prefill_step_s - m.prefill_expert_s
    latency, per_read = fit_read_line(m.read_batches, m.read_seconds)
    p = CostParams(
        dense_s=dense,
        dense_per_token_s=max((dense_prefill - dense) / max(m.prefill_tokens - 1, 1), 0.0),
        expert_call_s=max(per_expert - row, 0.0),
        expert_row_s=row,
        read_latency_s=latency,
        read_s_per_mib=per_read / m.read_mib_per_expert,
        layer_fixed_s=fixed,
    )
    p.nonoverlap_s_per_mib = _fit_nonoverlap(
        m, dense + m.layers * fixed, per_expert, latency, per_read, m.layers * m.read_mib_per_expert
    )
    if m.page_step_s is not None and m.page_missed_mib:
        compute = dense + m.layers * (fixed + m.top_k * per_expert)
        p.page_cache_s_per_mib = max((m.page_step_s - compute) / m.page_missed_mib, 0.0)
        p.page_cached_per_byte = max(m.page_cached_per_byte or 1.0, 1.0)
        p.page_readahead = m.page_readahead
        if m.page_limit_step_s is not None and m.page_limit_evicted_mib:
            p.page_limit_s_per_mib = max((m.page_limit_step_s - compute) / m.page_limit_evicted_mib, 0.0)
    return p


def _fit_nonoverlap(m: Measurements, base: float, per_expert: float, latency: float, per_read: float, mib: float):
    """g of `T = overlapped + g x MiB missed` over every miss level timed (all-miss and partial), least squares on
    relative error (each step's residual over its own seconds, so the all-miss step does not outweigh the rest).
    `mib` is MiB per miss per layer summed over layers; `base` the step's dense and per-layer fixed seconds."""
    levels = [(m.miss_step_s, m.miss_per_layer), *zip(m.partial_miss_step_s, m.partial_miss_per_layer)]
    num = den = 0.0
    for seconds, misses in levels:
        x = misses * mib
        if x <= 0 or seconds <= 0:
            continue
        overlapped = base + m.layers * float(layer_seconds(m.top_k, misses, per_expert, latency, per_read))
        num += (seconds - overlapped) * x / seconds**2
        den += x * x / seconds**2
    return max(num / den, 0.0) if den else 0.0
