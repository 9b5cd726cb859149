"""`tune --calibrate`: seconds of the engine and the reader on this machine, the terms of `sim.overlap_model`.

On one loaded model, with routing fixed by us (so that what is resident and what misses is known):
1. the reader alone: batches of 1, 2, 4, ... top-k experts, as a layer's misses are queued (latency, bandwidth),
   each read twice: where the second read is faster (a disk with a cache of its own, as a VM's host has), the
   experts of the timed steps below are read once beforehand, as decode's misses were read before;
2. page cache: every step chooses experts no step chose before, none in the page cache, through mmap (cost per
   missed MiB, and how many bytes the kernel's readahead brings in per byte touched); one expert per layer alone,
   and how far the kernel read ahead of and past each of its spans (mincore); then the same with this process
   moved into a small memory cgroup, so that every fault first reclaims (what a MiB the kernel reads costs a page
   cache at its limit, counted by /proc/self/io; needs root and a memory controller, else not measured);
3. compute only: the same top-k experts every step, resident after the first, then one of them per layer (dense
   seconds, per-expert seconds and the MoE block's own per-layer seconds), alternating with the expert cache with
   some and with every expert missing: 1 and a quarter of top-k fresh experts per layer beside resident ones, then
   a fresh top-k each step at a 1x cache (what reads cost beyond overlap, fitted over all the levels), so that a
   neighbour's burst of load hits every run alike;
4. a prefill of `PREFILL_TOKENS` tokens on resident experts (per-row seconds, dense seconds per token).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import StoppingCriteriaList

from weightstream.bench.read_timing import ExpertReads, read_timing
from weightstream.bench.reclaim import paused_proactive_reclaim
from weightstream.cache.expert_cache import ExpertCache
from weightstream.engine.generate import StepClock
from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg
from weightstream.engine.page_cache_source import PageCacheSource
from weightstream.io.pagecache import cached_bytes, evict_file, process_read_bytes, resident_pages
from weightstream.sim.overlap_model import Measurements
from weightstream.units import MIB, PAGE

ROUNDS = 2  # compute-only and all-miss runs alternate this many times
DECODE_STEPS = 12  # compute-only decode steps timed per round (after the step that reads them in)
MISS_STEPS = 3  # all-miss decode steps timed per round, expert cache
PAGE_STEPS = 2  # all-miss decode steps timed, page cache (each reads a whole token's experts through faults)
READAHEAD_PASSES = 3  # lone-expert steps whose readahead is measured (different experts each)
PREFILL_TOKENS = 32
REPEAT_FASTER = 1.15  # the disk serves a repeated read this much faster than a first one: it caches (a VM's host)


class FixedRouting:
    """Routing override: at step s every token of routed layer i chooses `choose(s, i)` (a list of top-k experts)."""

    def __init__(self, layers: list[int], choose: Callable[[int, int], list[int]]):
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.first, self.choose, self.step = layers[0], choose, -1

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if layer == self.first:
            self.step += 1
        chosen = torch.tensor(self.choose(self.step, self.pos[layer]), dtype=top_k_index.dtype)
        chosen = chosen.expand(top_k_index.shape[0], -1)
        weights = torch.full(chosen.shape, 1.0 / chosen.shape[1], dtype=top_k_weights.dtype)
        return chosen, weights


def timed_steps(model, prompt: list[int], steps: int) -> tuple[tuple[float, float], list[tuple[float, float]]]:
    """(prefill (seconds, expert seconds), [each decode step's (seconds, expert seconds)]) of `steps` forward steps."""
    counters = model.weightstream.counters
    clock = StepClock(lambda: (time.perf_counter(), counters.expert_s))  # the runtime's seconds inside the experts
    start = clock.snap()
    with torch.inference_mode(), quiet_cache_kwarg():
        model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            past_key_values=engine_cache(model, len(prompt) + steps),  # as engine.generate runs
        )
    marks = [start, *clock.marks]
    spans = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    return spans[0], spans[1:]


def _median(spans: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s for s, _ in spans), statistics.median(e for _, e in spans)


def _cached(paths: list[str]) -> int:
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            total += cached_bytes(fd)
        finally:
            os.close(fd)
    return total


READAHEAD_LOOK = 64 * MIB  # how far around a lone expert's span its readahead is looked for


def _window(start: int) -> int:
    """The first page `_resident_around` looks at for a span starting at byte `start`."""
    return max(start // PAGE - READAHEAD_LOOK // PAGE, 0)


def _resident_around(path: str, start: int, end: int) -> np.ndarray:
    """0/1 per page of `path` from `_window(start)` to `READAHEAD_LOOK` past `end` (clipped to the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        first = _window(start)
        last = min(-(-end // PAGE) + READAHEAD_LOOK // PAGE, -(-os.fstat(fd).st_size // PAGE))
        return resident_pages(fd, first * PAGE, (last - first) * PAGE)
    finally:
        os.close(fd)


def _read_around(start: int, end: int, new: np.ndarray) -> tuple[int, int]:
    """(bytes just before `start`, just past `end`) brought in, from `new` (pages resident now and not before,
    laid out as `_resident_around` lays them)."""
    first = _window(start)
    head, tail = new[: start // PAGE - first][::-1], new[-(-end // PAGE) - first :]
    return _run(head) * PAGE, _run(tail) * PAGE


def _run(resident: np.ndarray) -> int:
    """How many entries of `resident` are set before its first 0."""
    gaps = np.flatnonzero(resident == 0)
    return int(gaps[0]) if len(gaps) else len(resident)


def fresh_sets(n_experts: int, top_k: int, n_layers: int, seed: int) -> Callable[[int, int], list[int]]:
    """Step s takes the s-th group of top-k experts of a random order per layer: no two steps of a cycle overlap."""
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(n_experts).tolist() for _ in range(n_layers)]
    return lambda step, pos: [orders[pos][(step * top_k + j) % n_experts] for j in range(top_k)]


def partial_sets(resident: Callable[[int], list[int]], n_experts: int, missing: int, n_layers: int, seed: int):
    """Step s keeps the first top-k - `missing` experts of `resident(pos)` and adds `missing` experts that no other
    step of the cycle chose and that `resident(pos)` does not hold: each layer misses exactly `missing` a step."""
    rng = np.random.default_rng(seed)
    keep = [resident(pos) for pos in range(n_layers)]
    pools = [rng.permutation([e for e in range(n_experts) if e not in keep[pos]]).tolist() for pos in range(n_layers)]

    def choose(step: int, pos: int) -> list[int]:
        pool = pools[pos]
        fresh = [pool[(step * missing + j) % len(pool)] for j in range(missing)]
        return keep[pos][: len(keep[pos]) - missing] + fresh

    return choose


def miss_levels(top_k: int, n_experts: int) -> list[int]:
    """Misses per layer timed besides all of top-k: 1 and a quarter of top-k (a cache that mostly hits), where the
    experts outside one top-k leave room for `MISS_STEPS` + 1 steps without a repeat."""
    room = (n_experts - top_k) // (MISS_STEPS + 1)
    return sorted({m for m in (1, max(top_k // 4, 2)) if m < top_k and m <= room})


@dataclass
class Calibration:
    """What `Calibrator.run` measured: the terms `sim.overlap_model.fit_cost_params` fits, and what a saved
    calibration keeps beside them (`extra`)."""

    measurements: Measurements
    reader: dict  # `read_timing`'s batches and seconds, first reads and repeats
    primed: bool  # the disk served repeated reads faster: the timed steps' experts were read once beforehand
    compute_threads: int
    page_cache_at_limit: str | None = None  # why not, where the page cache was measured cold but not at its limit

    def extra(self) -> dict:
        """As `calibration_store.save` keeps it beside the measurements."""
        extra = {"reader": self.reader, "primed": self.primed, "compute_threads": self.compute_threads}
        if self.page_cache_at_limit is not None:
            extra["page_cache_at_limit"] = self.page_cache_at_limit
        return extra


class Calibrator:
    """Runs the four measurements on one loaded streaming model, each serving its experts from a source of its own
    (`StreamingRuntime.swap_cache`) with routing fixed by us (`StreamingRuntime.replaying`)."""

    def __init__(self, model, io_threads: int, chunk_bytes: int | None, progress=lambda msg: None):
        self.model, self.runtime = model, model.weightstream
        self.layout = self.runtime.layout
        self.io_threads, self.chunk_bytes, self.say = io_threads, chunk_bytes, progress
        self.layers = self.layout.layers
        self.n_experts = min(self.layout.num_experts.values())
        self.k = self.layout.top_k
        self.expert_nbytes = max(e.nbytes for e in self.layout.experts.values())

    def run(self) -> Calibration:
        """The four measurements. The runtime's own expert source is closed on the way (its memory goes to the
        measurements); the runtime serves afterwards from calibration's own expert cache (LRU, one token's working
        set), and from its router's routing again."""
        # dense weights are mapped from the checkpoint: touch them all before the page cache is measured, so that
        # their first faults count neither as expert faults nor as expert pages brought in
        self._steps(fresh_sets(self.n_experts, self.k, len(self.layers), seed=0), [1], 2)
        self.say("reader: batches of misses, O_DIRECT")
        reads = read_timing(self.layout, self.io_threads, self.chunk_bytes)
        self.prime = sum(reads["first_read_seconds"]) > REPEAT_FASTER * sum(reads["seconds"])
        with paused_proactive_reclaim():  # idle-page reclaim would count as page-cache misses (bench.reclaim)
            page, page_amplification = self.page_cache()
            readahead = self.page_readahead() if page is not None else None
            pressured, pressure_note = (
                self.page_cache_at_limit(page_amplification) if page is not None else (None, "not measured")
            )
        cache = ExpertCache(self.layout, self.layout.working_set_bytes, "lru", self.io_threads, self.chunk_bytes)
        self._serve(cache)
        try:
            decode = self.compute_and_misses()
            prefill = self.prefill()
        except BaseException:
            cache.close()
            raise
        nbytes = self.expert_nbytes
        m = Measurements(
            layers=len(self.layers),
            top_k=self.k,
            **decode,
            **prefill,
            read_batches=reads["batches"],
            read_seconds=reads["seconds"],
            read_mib_per_expert=reads["mib_per_expert"],
            page_step_s=page,
            page_missed_mib=len(self.layers) * self.k * nbytes / MIB if page is not None else None,
            page_cached_per_byte=page_amplification,
            page_readahead=readahead,
            **(pressured or {}),
        )
        return Calibration(
            m,
            reader=reads,
            primed=self.prime,
            compute_threads=torch.get_num_threads(),
            page_cache_at_limit=pressure_note if pressured is None and page is not None else None,
        )

    def _serve(self, source) -> None:
        """The runtime serves from `source` from now on; the source it served from is spent and closed here (each
        of calibration's own is closed already, at the end of the measurement that used it)."""
        self.runtime.swap_cache(source).close()

    def _steps(self, choose, prompt: list[int], steps: int):
        """`timed_steps` with every token of routed layer i choosing `choose(step, i)`."""
        with self.runtime.replaying(FixedRouting(self.layers, choose)):
            return timed_steps(self.model, prompt, steps)

    def _prime(self, choose, steps: range) -> None:
        """Where the disk serves repeated reads faster, read the experts of the timed steps once beforehand:
        decode's misses are mostly experts read before, and the timed run should see them as decode does."""
        if not self.prime:
            return
        keys = [(layer, e) for s in steps for pos, layer in enumerate(self.layers) for e in choose(s, pos)]
        reads = ExpertReads(self.layout, self.io_threads, self.chunk_bytes, max_batch=2 * self.k)
        try:
            reads.prime(keys)
        finally:
            reads.close()

    def _mmap_steps(self, choose, steps: int, cgroup=None) -> tuple[list, list[str], int, int | None]:
        """`steps` forward steps with every expert served through mmap, routed by `choose`, none of the experts in
        the page cache at the start (inside `cgroup` where given: this process moves in for the steps and back out
        after): (decode spans, expert files, bytes that stayed cached on eviction, bytes the kernel read for this
        process during the steps, None where it does not count)."""
        from weightstream.cgroup import CgroupMemory

        self._prime(choose, range(1, steps))
        paths = sorted({p.path for e in self.layout.experts.values() for p in e.pieces})
        before = sum(evict_file(path) for path in paths)  # what stays: pages someone maps (dense weights)
        source = PageCacheSource(self.layout)
        self._serve(source)
        home = CgroupMemory.of() if cgroup is not None else None
        try:
            if cgroup is not None:
                (cgroup.path / "cgroup.procs").write_text(str(os.getpid()))
            try:
                first = process_read_bytes()
                _, decode = self._steps(choose, [1], steps)
                last = process_read_bytes()
            finally:
                if home is not None:
                    (home.path / "cgroup.procs").write_text(str(os.getpid()))
        finally:
            source.close()  # its mappings gone: the next eviction drops the pages it faulted
        return decode, paths, before, (last - first if first is not None and last is not None else None)

    def page_cache(self) -> tuple[float | None, float | None]:
        """(median seconds of a decode step whose every expert is faulted in cold through mmap, bytes the page
        cache took in per expert byte touched: the kernel's readahead reads around each fault)."""
        steps = min(PAGE_STEPS + 1, self.n_experts // self.k)
        if steps < 2:
            return None, None
        self.say("page cache: experts through mmap, none of them in the page cache")
        choose = fresh_sets(self.n_experts, self.k, len(self.layers), seed=1)
        decode, paths, before, _ = self._mmap_steps(choose, steps=steps)
        touched = steps * len(self.layers) * self.k * self.expert_nbytes
        return _median(decode)[0], max((_cached(paths) - before) / touched, 1.0)

    def page_readahead(self) -> list[list[int]] | None:
        """[bytes cached ahead of it, bytes cached past it] for each span of an expert faulted in alone through
        mmap (one expert per layer, so that nothing else touched is near): the read-around window and the
        asynchronous readahead as the engine's own access order meets them. `READAHEAD_PASSES` passes on different
        experts, medians over every pass and layer, as one pass alone may see less readahead than decode meets
        (docs/tune.md). None where an expert's spans differ between layers."""
        self.say("page cache: one expert per layer through mmap, the readahead around it")
        samples = []  # per pass and layer: (ahead, past) of each span
        for i in range(READAHEAD_PASSES):
            samples += self._readahead_pass((self.n_experts * (i + 1)) // (READAHEAD_PASSES + 1))
        if len({len(s) for s in samples}) != 1:
            return None
        return [[int(statistics.median(s[i][j] for s in samples)) for j in (0, 1)] for i in range(len(samples[0]))]

    def _readahead_pass(self, expert: int) -> list[list[tuple[int, int]]]:
        """One step with `expert` alone in every layer, from evicted files: (ahead, past) per span, per layer."""
        from weightstream.cache.slot_plan import expert_spans

        spans = []  # per layer: (path, start, end) of each span of the expert
        for layer in self.layers:
            where = self.layout.experts[(layer, expert)]
            names = sorted({p.path for p in where.pieces})
            merged = expert_spans(where, {name: i for i, name in enumerate(names)})
            spans.append([(names[f], a, b) for f, a, b in merged])
        for path in {path for layer in spans for path, _, _ in layer}:
            evict_file(path)  # what stays is mapped (dense weights): not the readahead's
        stayed = [[_resident_around(*span) for span in layer] for layer in spans]
        self._mmap_steps(lambda step, pos: [expert], steps=1)
        return [
            [_read_around(a, b, _resident_around(path, a, b) & (1 - kept)) for (path, a, b), kept in zip(layer, k)]
            for layer, k in zip(spans, stayed)
        ]

    def page_cache_at_limit(self, amplification: float | None) -> tuple[dict | None, str]:
        """Decode steps through mmap with this process in a memory cgroup that one layer's faults fill, so that
        every further fault reclaims first, as a run at its memory limit does: ({"page_limit_step_s",
        "page_limit_evicted_mib"} (MiB the kernel read per step, /proc/self/io, each after a reclaim; touched x
        readahead where the kernel does not count), "measured"),
        or (None, why not) where no cgroup can be made (not root)."""
        from weightstream.cgroup import CgroupMemory, MemoryCgroup
        from weightstream.errors import WeightstreamError

        steps = min(PAGE_STEPS + 2, self.n_experts // self.k)
        if steps < 3 or CgroupMemory.of() is None or os.geteuid() != 0:
            return None, "not measured: needs root and a memory cgroup controller"
        per_layer = self.k * self.expert_nbytes * max(amplification or 1.0, 1.0)
        limit = int(max(per_layer, 64 * MIB))  # every layer's faults reclaim the layer before
        try:
            group = MemoryCgroup.create(limit, name="ws-calibrate")
        except WeightstreamError as exc:
            return None, f"not measured: {exc}"
        self.say(f"page cache at its limit: experts through mmap in a {limit / MIB:.0f} MiB cgroup")
        try:
            choose = fresh_sets(self.n_experts, self.k, len(self.layers), seed=2)
            decode, _, _, read = self._mmap_steps(choose, steps=steps, cgroup=group)  # the first step fills it
        except OSError as exc:
            return None, f"not measured: cannot move this process between memory cgroups ({exc.strerror})"
        finally:
            group.remove()
        measured = {
            "page_limit_step_s": _median(decode[1:])[0],
            # what the kernel read per step (every step faults a fresh top-k), else what readahead should read
            "page_limit_evicted_mib": (read / steps if read else len(self.layers) * per_layer) / MIB,
        }
        return measured, "measured"

    def compute_and_misses(self) -> dict:
        """Compute-only decode (the same experts every step, resident after the first), decode with `miss_levels`
        fresh experts per layer beside resident ones, and all-miss decode (a fresh top-k per layer every step at a
        1x cache), in alternating rounds so that all of them see the same machine."""
        fixed = fresh_sets(self.n_experts, self.k, len(self.layers), seed=4)
        levels = miss_levels(self.k, self.n_experts)
        resident, one = [], []
        missing = {m: ([], []) for m in [*levels, self.k]}  # misses per layer: (step spans, misses counted)
        for round_ in range(ROUNDS):
            self.say(f"compute only, some and every expert missing, round {round_ + 1} of {ROUNDS}")
            resident += self._steps(lambda step, pos: fixed(0, pos), [1], DECODE_STEPS + 1)[1]
            # resident: one of the experts just timed
            one += self._steps(lambda step, pos: fixed(0, pos)[:1], [1], DECODE_STEPS + 1)[1]
            for m in levels:  # the rest of top-k stays resident: read in by the compute-only run just before
                seed = 20 + 10 * round_ + m
                self._misses(
                    partial_sets(lambda pos: fixed(0, pos), self.n_experts, m, len(self.layers), seed), *missing[m]
                )
            self._misses(fresh_sets(self.n_experts, self.k, len(self.layers), seed=10 + round_), *missing[self.k])
        step_s, expert_s = _median(resident)
        all_spans, all_counts = missing.pop(self.k)
        return {
            "decode_step_s": step_s,
            "decode_expert_s": expert_s,
            "decode_one_expert_s": _median(one)[1],
            "miss_step_s": _median(all_spans)[0],
            "miss_per_layer": statistics.mean(all_counts),
            "partial_miss_step_s": [_median(spans)[0] for spans, _ in missing.values()],
            "partial_miss_per_layer": [statistics.mean(counts) for _, counts in missing.values()],
        }

    def _misses(self, choose, spans: list, counts: list) -> None:
        """Times `MISS_STEPS` decode steps routed by `choose` (their misses primed where the disk caches repeats):
        adds the steps' spans and the misses per layer per step counted by the cache."""
        self._prime(choose, range(1, MISS_STEPS + 1))
        before = self.runtime.cache.stats.misses
        spans += self._steps(choose, [1], MISS_STEPS + 1)[1]
        counts.append((self.runtime.cache.stats.misses - before) / (MISS_STEPS + 1) / len(self.layers))

    def prefill(self) -> dict:
        """A prefill of `PREFILL_TOKENS` tokens on resident experts (every token choosing the same ones)."""
        self.say("compute only: a prefill")
        fixed = fresh_sets(self.n_experts, self.k, len(self.layers), seed=4)
        self._steps(lambda step, pos: fixed(0, pos), [1], 1)  # reads them in
        prefills = []
        for _ in range(3):
            prefills.append(self._steps(lambda step, pos: fixed(0, pos), [1] * PREFILL_TOKENS, 1)[0])
        prefill_s, prefill_expert_s = _median(prefills)
        return {"prefill_tokens": PREFILL_TOKENS, "prefill_step_s": prefill_s, "prefill_expert_s": prefill_expert_s}
