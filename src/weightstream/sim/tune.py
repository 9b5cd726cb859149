"""`tune`'s search: every policy at every cache size that fits, and the page cache, replayed and turned into speed.

The routing is a trace in the model's shape (`trace.remap.onto_shape`), replayed from an empty cache with every
access counted, as a fresh engine would run it. Each (policy, size) gives misses per step and layer; the cost model
(`overlap_model`, or bench's linear fit) turns them into seconds per step. Decode figures count the single-token
steps after each request's first step; prefill is each request's first step. Where the checkpoint has small copies
(`quantize --miss-bits`), each expert-cache configuration is also priced with `--miss-copy` at several upgrade
settings, from the same replay (`sim.miss_copy`): those configurations are kept apart, since their tokens are not the
model's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from weightstream.cache.policies import POLICY_NAMES
from weightstream.sim.cost_model import CostModel
from weightstream.sim.miss_copy import SMALL_HIT, UPGRADE, MissCopy, calls_kinds, setting_name
from weightstream.sim.overlap_model import (
    CostParams,
    StepLoad,
    expert_cache_step_s,
    linear_step_s,
    page_cache_step_s,
)
from weightstream.sim.page_cache_model import PageCacheModel, Readahead
from weightstream.sim.page_cache_model import replay as replay_page_cache
from weightstream.sim.replay import Options, access_calls, access_hits
from weightstream.sim.workload import Workload
from weightstream.store.facts import is_lazy_dense
from weightstream.trace import Trace
from weightstream.units import MIB

if TYPE_CHECKING:
    from weightstream.store.layout import ModelLayout

TUNE_POLICIES = POLICY_NAMES  # lru, slru, lfu, pinned, adaptive; belady is the bound
MULTIPLES = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16, 24, 32)
ADAPTIVE_THRESHOLD = 1.8
MISS_COPY_UPGRADES = (1, 2, 4, 8, None)  # --upgrade-after settings tune prices where the checkpoint has small copies


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the search needs of the checkpoint and the runtime."""

    layers: int  # routed layers
    n_experts: int  # per layer
    top_k: int  # the model's own
    expert_nbytes: int  # one expert's bytes (what the page cache holds of it)
    slot_bytes: int  # one cache slot
    read_bytes: int  # what the reader fetches for one miss (4 KiB-aligned spans)
    working_set_bytes: int  # one token's working set as the runtime counts it (its 1x)
    # where each expert lies in the checkpoint: spans[layer position][expert] = ((file id, start, end), ...), the
    # files' sizes and the kernel's readahead window; the page-cache row needs them (`model_facts`)
    spans: tuple | None = None
    file_bytes: tuple[int, ...] | None = None
    readahead_window: int | None = None
    # dense weights each forward step reads, which share the page cache's lists with the experts: spans before each
    # routed layer's experts, then those after the last (`dense_spans`); None: left out
    dense_spans: tuple | None = None
    # what the reader fetches for one small copy (`quantize --miss-bits`, read on a miss under `--miss-copy`); None:
    # the checkpoint has none
    small_read_bytes: int | None = None

    @property
    def total_experts(self) -> int:
        return self.layers * self.n_experts


def model_facts(layout: ModelLayout, tied: bool = False, readahead_window: int | None = None) -> ModelFacts:
    """The checkpoint facts the search needs, with the reader's aligned bytes per miss from the slot plans; `tied`:
    the output head is the input embedding (so every step reads all of it, `store.facts.ties_embeddings`);
    `readahead_window`: the kernel's on the device the checkpoint is on (`bench.machine.read_ahead_bytes`)."""
    from weightstream.cache.slot_plan import expert_spans, plan_slot

    small = layout.small_copies or {}
    file_sizes = {
        p.path: os.path.getsize(p.path) for e in (*layout.experts.values(), *small.values()) for p in e.pieces
    }
    file_sizes.update({t.path: os.path.getsize(t.path) for t in layout.dense.values()})
    firsts = [layout.experts[(layer, 0)] for layer in layout.layers]
    file_ids = {path: i for i, path in enumerate(sorted(file_sizes))}
    n_experts = min(layout.num_experts.values())
    spans = tuple(
        tuple(tuple(expert_spans(layout.experts[(layer, e)], file_ids)) for e in range(n_experts))
        for layer in layout.layers
    )
    return ModelFacts(
        layers=len(layout.layers),
        n_experts=n_experts,
        top_k=layout.top_k,
        expert_nbytes=max(e.nbytes for e in layout.experts.values()),
        slot_bytes=layout.slot_bytes,
        read_bytes=max(plan_slot(e, file_sizes).aligned_bytes for e in firsts),
        working_set_bytes=layout.working_set_bytes,
        spans=spans,
        file_bytes=tuple(file_sizes[path] for path in file_ids),
        dense_spans=dense_spans(layout, file_ids, tied),
        readahead_window=readahead_window,
        small_read_bytes=max(plan_slot(small[(layer, 0)], file_sizes).aligned_bytes for layer in layout.layers)
        if small
        else None,
    )


def dense_spans(layout: ModelLayout, file_ids: dict[str, int], tied: bool) -> tuple:
    """Where each step's dense weights lie: for each routed layer the spans of the dense tensors a forward step reads
    before that layer's experts (its attention, norms and router, and those of any dense layer before it), then the
    spans read after the last one (the output head, the final norm). An untied input embedding is left out: a step
    reads one row of it per token (`sim.budget.lazy_dense_bytes`)."""
    from weightstream.cache.slot_plan import PAGE, merge_spans
    from weightstream.store.layout import layer_index

    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(len(layout.layers) + 1)]
    for name, t in layout.dense.items():
        if is_lazy_dense(name, tied):
            continue
        layer = layer_index(name, max(layout.layers) + 1)
        pos = int(np.searchsorted(layout.layers, layer))  # the first routed layer at or after it
        groups[pos].append((file_ids[t.path], t.offset, t.nbytes))
    return tuple(tuple(merge_spans(g, PAGE)) for g in groups)


@dataclass(slots=True)
class Config:
    """One configuration's simulated reads and predicted speed."""

    path: str  # expert-cache or page-cache
    policy: str
    cache_bytes: int
    slots: int
    hit_rate: float  # decode lookups
    mib_read_per_token: float  # decode
    predicted_decode_tokens_per_s: float | None
    predicted_prefill_s: float | None
    bound: bool = False  # Belady: what no policy can beat
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "policy": self.policy,
            "cache_bytes": self.cache_bytes,
            "slots": self.slots,
            "hit_rate": self.hit_rate,
            "mib_read_per_token": self.mib_read_per_token,
            "predicted_decode_tokens_per_s": self.predicted_decode_tokens_per_s,
            "predicted_prefill_s": self.predicted_prefill_s,
            "bound": self.bound,
            **self.extra,
        }


class Steps:
    """Per-access step and layer indices of a workload, and which steps are decode and which prefill."""

    def __init__(self, w: Workload):
        t = w.trace
        self.n_steps, self.n_layers = t.n_steps, len(t.shape.layers)
        gid = np.repeat(np.arange(len(t.group_layer)), np.diff(t.group_offsets))
        step_of_group = np.repeat(np.arange(t.n_steps), np.diff(t.step_groups))
        layer_of_group = np.searchsorted(np.asarray(t.shape.layers), t.group_layer)
        self.cell = (step_of_group * self.n_layers + layer_of_group)[gid]  # (step, layer) of each access
        pairs = np.unique(gid.astype(np.int64) * w.n_keys + w.keys)  # distinct (group, expert)
        cells = (step_of_group * self.n_layers + layer_of_group)[pairs // w.n_keys]
        self.distinct = np.bincount(cells, minlength=self.n_steps * self.n_layers).reshape(self.n_steps, -1)
        first = np.r_[True, t.step_request[1:] != t.step_request[:-1]]
        self.prefill = first
        self.decode = ~first & (t.step_tokens == 1)
        self.tokens, self.top_k = t.step_tokens.astype(np.int64), t.shape.top_k

    def load(self, hit: np.ndarray) -> StepLoad:
        misses = np.bincount(self.cell[~hit], minlength=self.n_steps * self.n_layers).reshape(self.n_steps, -1)
        return StepLoad(self.tokens, self.distinct, misses, self.top_k)

    def decode_hit_rate(self, hit: np.ndarray) -> float:
        mask = self.decode[self.cell // self.n_layers]
        return float(hit[mask].mean()) if mask.any() else float(hit.mean())


def cache_sizes(facts: ModelFacts, expert_budget: int) -> list[int]:
    """Cache sizes from 1x to the budget (each a distinct slot count), the budget itself last."""
    all_experts = facts.total_experts * facts.slot_bytes
    top = min(expert_budget, all_experts)
    sizes = [int(m * facts.working_set_bytes) for m in MULTIPLES if m * facts.working_set_bytes <= top] + [top]
    by_slots = {min(s // facts.slot_bytes, facts.total_experts): s for s in sizes}
    return sorted(by_slots.values())


class Search:
    """Replays one routing trace (in the model's shape) and predicts each configuration's speed."""

    def __init__(self, trace: Trace, facts: ModelFacts, params: CostParams | None, linear: CostModel | None = None):
        self.w, self.facts, self.params, self.linear = Workload(trace, 0.0), facts, params, linear
        self.steps = Steps(self.w)
        self.sim_expert_bytes = trace.shape.expert_bytes[0]
        # the runtime's adaptive compares slots with the model's top-k working set, the simulator with the trace's
        ratio = facts.top_k * facts.layers / trace.shape.working_set_slots
        self.options = Options(threshold=ADAPTIVE_THRESHOLD * ratio)
        self.miss_copy_configs: list[Config] = []  # `run` with miss_copy

    def expert_cache(self, policy: str, cache_bytes: int) -> Config:
        """`policy` at `cache_bytes` of runtime budget (slots as the runtime counts them)."""
        slots, hit = self._replay(policy, cache_bytes)
        return self._expert_config(policy, cache_bytes, slots, hit)

    def miss_copy(self, policy: str, cache_bytes: int, miss_copy: MissCopy) -> list[Config]:
        """`policy` at `cache_bytes` with `--miss-copy`, one configuration per upgrade setting of `miss_copy` (whose
        ratio is a small copy's read bytes over a blob's): tokens not the model's."""
        slots, hit = self._replay(policy, cache_bytes)
        exact = self._expert_config(policy, cache_bytes, slots, hit)
        return self._miss_copy_configs(exact, hit, miss_copy)

    def _replay(self, policy: str, cache_bytes: int) -> tuple[int, np.ndarray]:
        slots = min(cache_bytes // self.facts.slot_bytes, self.facts.total_experts)
        return slots, access_hits(self.w, policy, slots * self.sim_expert_bytes, self.options)

    def _seconds(self, load: StepLoad, read_mib: float | np.ndarray) -> np.ndarray | None:
        if self.linear is not None:
            return linear_step_s(self.linear, load, read_mib)
        if self.params is not None:
            return expert_cache_step_s(self.params, load, read_mib)
        return None

    def _expert_config(self, policy: str, cache_bytes: int, slots: int, hit: np.ndarray) -> Config:
        load = self.steps.load(hit)
        read_mib = self.facts.read_bytes / MIB
        seconds = self._seconds(load, read_mib)
        return self._config(
            "expert-cache", policy, cache_bytes, slots, hit, load, read_mib, seconds, policy == "belady"
        )

    def _miss_copy_configs(self, exact: Config, hit: np.ndarray, miss_copy: MissCopy) -> list[Config]:
        """`exact`'s replay (its hit mask) with small copies: each miss reads one (`ratio` of a blob), each upgrade a
        full blob, awaited like a miss; the policy's hits and misses are exact mode's (`sim.miss_copy`)."""
        steps, decode = self.steps, self.steps.decode
        cells = (steps.n_steps, steps.n_layers)
        calls = access_calls(self.w, exact.slots * self.sim_expert_bytes)
        full_mib = self.facts.read_bytes / MIB
        small = np.bincount(steps.cell[~hit], minlength=cells[0] * cells[1]).reshape(cells)
        out = []
        for n in miss_copy.upgrade_after:
            kind = calls_kinds(calls, hit, self.w.n_keys, n)
            upgrade = kind == UPGRADE
            load = self.steps.load(hit & ~upgrade)  # an upgrade is read before its layer computes, as a miss is
            read = small * (miss_copy.ratio * full_mib) + (load.misses - small) * full_mib  # [S, L] MiB
            seconds = self._seconds(load, read / np.maximum(load.misses, 1))
            config = self._config("expert-cache", exact.policy, exact.cache_bytes, exact.slots, hit, load, 0.0, seconds)
            config.mib_read_per_token = _decode_mean(read.sum(axis=1), decode)
            per_step = np.bincount(steps.cell[kind == SMALL_HIT] // steps.n_layers, minlength=steps.n_steps)
            config.extra = {
                "miss_copy": True,
                "exact": False,  # tokens differ from the model's
                "upgrade_after": setting_name(n),
                "small_copy_ratio": miss_copy.ratio,
                "small_reads_per_token": _decode_mean(small.sum(axis=1), decode),
                "upgrades_per_token": _decode_mean((load.misses - small).sum(axis=1), decode),
                "small_hits_per_token": _decode_mean(per_step, decode),
                "exact_mib_read_per_token": exact.mib_read_per_token,
                "exact_predicted_decode_tokens_per_s": exact.predicted_decode_tokens_per_s,
            }
            out.append(config)
        return out

    def page_cache(self, room_bytes: int) -> Config:
        """mmap with `room_bytes` of page cache for experts: the kernel's two lists over the checkpoint's real
        byte ranges (`sim.page_cache_model`), with the dense weights in the same lists where `dense_spans` says
        where they lie, each fault reading the calibrated readahead around it."""
        facts = self.facts
        if facts.spans is None:
            raise ValueError("the page-cache model needs the checkpoint's byte ranges (ModelFacts.spans)")
        known = self.params is not None and self.params.page_cache_s_per_mib is not None
        spread = self.params.page_cached_per_byte if known else 1.0
        n = self.w.trace.shape.n_experts
        spans = [facts.spans[key // n][key % n] for key in range(self.w.n_keys)]
        measured = self.params.page_readahead if known else None
        readahead = [
            tuple(Readahead(*ra) for ra in measured)
            if measured and len(measured) == len(s)
            else Readahead.per_span(spread, s, facts.readahead_window)
            for s in spans
        ]
        keys, cell, room = self.w.keys, self.steps.cell, room_bytes
        if facts.dense_spans:  # the process's file pages are the experts' room and its mapped dense weights
            keys, cell, is_expert = self._with_dense_steps()
            spans += list(facts.dense_spans)
            readahead += [(Readahead(0, 0),) * len(d) for d in facts.dense_spans]  # dense next to dense: read anyway
            room += sum(b - a for d in facts.dense_spans for _, a, b in d)
        chunk = max(MIB, _pow2_at_least(facts.expert_nbytes // 32))  # at most ~32 chunks per expert
        model = PageCacheModel(spans, room, readahead, chunk, facts.file_bytes)
        hit, read, evicted = replay_page_cache(model, keys)
        if facts.dense_spans:
            hit = hit[is_expert]
        load = self.steps.load(hit)
        step = cell // self.steps.n_layers
        read_mib = np.bincount(step, weights=read / MIB, minlength=self.steps.n_steps)
        evicted_mib = np.bincount(step, weights=evicted / MIB, minlength=self.steps.n_steps)
        seconds = None
        if known:  # calibrated per expert MiB touched with `spread` bytes read per byte: per MiB read, divide
            p = self.params
            cold = p.page_cache_s_per_mib / spread  # a read into free room
            at_limit = cold if p.page_limit_s_per_mib is None else p.page_limit_s_per_mib  # a read that reclaims
            reclaiming = np.minimum(evicted_mib, read_mib)
            seconds = page_cache_step_s(p, load, 0.0) + cold * (read_mib - reclaiming) + at_limit * reclaiming
        slots = int(room_bytes // facts.expert_nbytes)
        config = self._config("page-cache", "kernel (two-list model)", room_bytes, slots, hit, load, 0.0, seconds)
        decode = self.steps.decode
        config.mib_read_per_token = float(read_mib[decode].mean()) if decode.any() else 0.0
        config.extra = {
            "page_cached_per_byte": spread,
            "readahead_bytes_per_span": [[r.before, r.after] for r in readahead[0]],  # (before, after), one expert
            "model_chunk_bytes": chunk,
        }
        return config

    def _with_dense_steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The workload's accesses with each step's dense reads put in: a routed layer's dense key (n_keys + its
        position) before its first expert of the step, the head's (n_keys + layers) after the step's last access.
        (keys, (step, layer) cell of each, which of them are experts)."""
        cell, n_layers, n_keys = self.steps.cell, self.steps.n_layers, self.w.n_keys
        starts = np.r_[True, cell[1:] != cell[:-1]]
        ends = np.r_[cell[1:] // n_layers != cell[:-1] // n_layers, True]
        out: list[tuple[int, int, bool]] = []  # (key, cell, an expert)
        for key, c, first, last in zip(self.w.keys.tolist(), cell.tolist(), starts.tolist(), ends.tolist()):
            if first:
                out.append((n_keys + c % n_layers, c, False))
            out.append((key, c, True))
            if last:
                out.append((n_keys + n_layers, c, False))
        keys, cells, expert = zip(*out)
        return np.asarray(keys, np.int64), np.asarray(cells, np.int64), np.asarray(expert, bool)

    def _config(self, path, policy, cache_bytes, slots, hit, load, mib_per_miss, seconds, bound=False) -> Config:
        decode = self.steps.decode
        steps_missed = load.misses.sum(axis=1)
        mib_per_token = float(steps_missed[decode].mean() * mib_per_miss) if decode.any() else 0.0
        tok_s = prefill = None
        if seconds is not None and decode.any():
            tok_s = float(decode.sum() / seconds[decode].sum())
            prefill = None if self.linear is not None else float(seconds[self.steps.prefill].mean())
        return Config(
            path,
            policy,
            int(cache_bytes),
            int(slots),
            self.steps.decode_hit_rate(hit),
            mib_per_token,
            tok_s,
            prefill,
            bound,
        )

    def run(
        self,
        expert_budget: int,
        policies=TUNE_POLICIES,
        sizes: list[int] | None = None,
        miss_copy: MissCopy | None = None,
    ) -> list[Config]:
        """Every policy (and Belady) at every size, then the page cache with the whole expert budget. With `miss_copy`,
        every policy at every size is also priced with small copies, from the same replay, into
        `self.miss_copy_configs` (apart from the returned ones: their tokens are not the model's)."""
        sizes = sizes or cache_sizes(self.facts, expert_budget)
        configs, self.miss_copy_configs = [], []
        for size in sizes:
            bound = self.expert_cache("belady", size)
            for policy in policies:
                slots, hit = self._replay(policy, size)
                config = self._expert_config(policy, size, slots, hit)
                config.extra = _distance(config, bound)
                configs.append(config)
                if miss_copy is not None:
                    self.miss_copy_configs += self._miss_copy_configs(config, hit, miss_copy)
            configs.append(bound)
        configs.append(self.page_cache(expert_budget))
        return configs


def _decode_mean(per_step: np.ndarray, decode: np.ndarray) -> float:
    """Mean of a per-step figure over the decode steps (one token each)."""
    return float(per_step[decode].mean()) if decode.any() else 0.0


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _distance(config: Config, bound: Config) -> dict:
    """How far a configuration is from Belady's bound at its size."""
    out = {"belady_mib_read_per_token": bound.mib_read_per_token}
    if config.predicted_decode_tokens_per_s and bound.predicted_decode_tokens_per_s:
        out["of_belady_tokens_per_s"] = config.predicted_decode_tokens_per_s / bound.predicted_decode_tokens_per_s
    return out
