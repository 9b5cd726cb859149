"""Greedy generation with the measurements weightstream reports: prefill time, decode speed, hits, bytes read."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg
from weightstream.errors import WeightstreamError


@dataclass(slots=True)
class GenerationStats:
    """What one generate call measured; `bytes_read` counts bytes the reader fetched from the device."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    expert_hit_rate: float = 0.0
    decode_expert_hit_rate: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0
    bytes_read: int = 0
    expert_bytes_missed: int = 0
    prefill_bytes_read: int = 0
    bytes_read_per_token: float = 0.0
    io_wait_s: float = 0.0
    decode_io_wait_s: float = 0.0
    expert_cache_bytes: int = 0
    expert_cache_slots: int = 0
    working_set_bytes: int = 0
    io_threads: int = 0
    o_direct: bool = True
    predict_next: bool = False
    readahead_issued: int = 0  # predicted experts read ahead of demand
    readahead_used: int = 0  # of those, found by a demand lookup (counted as hits there)
    readahead_wasted: int = 0  # of those, evicted before any demand lookup found them
    prediction_accuracy: float = 0.0  # share of the layers' actual top-k choices that were predicted
    decode_prediction_accuracy: float = 0.0
    layer_misses: dict = field(default_factory=dict)
    # weight bytes one decode token touches: the dense weights it multiplies by (not an untied input embedding,
    # of which it reads one row) and the experts it looks up; what a memory-bound decode must read per token
    weight_bytes_per_token: float = 0.0
    # --miss-copy: misses read small copies of these bits (0: exact mode, every expert computed as the checkpoint
    # stores it; else tokens are not the model's exact ones), how many and their bytes; hits on a small copy that read
    # the full blob first (`upgrades`) and their bytes. Both read kinds are in bytes_read and expert_bytes_missed too
    miss_copy_bits: int = 0
    miss_copy_reads: int = 0
    miss_copy_bytes_read: int = 0
    upgrades: int = 0
    upgrade_bytes_read: int = 0
    miss_copy_hits: int = 0  # hits computed with the small copy (--upgrade-after above 1), nothing read
    # DeepSeek's latent attention: "absorbed" (over the cached latent) or "expanded" (transformers'); None: none
    latent_attention: str | None = None
    kv_cache_bytes_per_token: int = 0  # every layer's keys and values (or latent and rotary key) for one position
    kv_dtype: str | None = None  # the dtype the KV cache keeps them in

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class _Snapshot:
    t: float
    hits: int
    misses: int
    bytes_read: int
    io_wait_s: float
    expert_bytes_missed: int
    read_ahead: tuple[int, int, int] = (0, 0, 0)  # issued, used, wasted
    predicted: tuple[int, int] = (0, 0)  # predicted, checked
    miss_copy: tuple[int, ...] = (0, 0, 0, 0, 0)  # small reads, their bytes, upgrades, their bytes, small hits


class StepClock(StoppingCriteria):
    """Marks `snap()` once after every forward step of transformers' `generate` (the first mark ends prefill),
    stopping nothing: the one way a forward step is timed here (`generate`, `timed_generate`; bench's calibration
    can snap its expert seconds with the time)."""

    def __init__(self, snap):
        self.snap, self.marks = snap, []

    def __call__(self, input_ids, scores, **kwargs):
        self.marks.append(self.snap())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def generate(
    model, input_ids: torch.Tensor, max_new_tokens: int = 32, prefill_chunk: int | None = None, **kwargs
) -> tuple[torch.Tensor, GenerationStats]:
    """Greedy by default; returns (generated ids only, stats of this call). With `prefill_chunk`, the prompt goes
    through the model that many positions per forward, as `serve` prefills it under the same chunk (so the two
    give the same tokens, bitwise), and no forward holds more than a chunk's temporaries whatever the prompt's
    length. A model that builds a cache of its own (`engine_cache` None) takes its prompt in one forward."""
    runtime = model.weightstream
    snap = lambda: _snapshot(runtime)  # noqa: E731
    clock = StepClock(snap)
    start = snap()
    if "past_key_values" not in kwargs:  # written in place, not concatenated every step (engine/kv_cache.py)
        kwargs["past_key_values"] = engine_cache(model, input_ids.shape[1] + max_new_tokens)  # None: its own
    with torch.inference_mode(), quiet_cache_kwarg():
        if prefill_chunk is not None and kwargs["past_key_values"] is not None:
            prefill_all_but_last(model, input_ids, kwargs["past_key_values"], prefill_chunk)
        out = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=kwargs.pop("do_sample", False),
            stopping_criteria=StoppingCriteriaList([clock]),
            **kwargs,
        )
    new = out[:, input_ids.shape[1] :]
    return new, _stats(runtime, input_ids.shape[1], new.shape[1], start, clock.marks)


def prefill_all_but_last(model, input_ids: torch.Tensor, cache, chunk: int) -> None:
    """Runs the prompt's chunks of `chunk` positions into `cache`, all but the last: `model.generate` then runs
    the last one (the positions the cache lacks) and samples from it."""
    if chunk < 1:
        raise WeightstreamError(f"--prefill-chunk {chunk}: must be at least 1 token")
    n = input_ids.shape[1]
    for begin in range(0, (n - 1) // chunk * chunk, chunk):
        end = begin + chunk
        model(
            input_ids=input_ids[:, begin:end],
            attention_mask=torch.ones(input_ids.shape[0], end, dtype=torch.long),
            position_ids=torch.arange(begin, end).expand(input_ids.shape[0], -1),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )


def timed_generate(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float, float, int]:
    """Greedy generation with any transformers model: (new ids, prefill s, decode s, decode steps)."""
    clock = StepClock(time.perf_counter)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, max_new_tokens=max_new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock])
        )
    marks = clock.marks
    return out[0, input_ids.shape[1] :].tolist(), marks[0] - start, marks[-1] - marks[0], len(marks) - 1


def _snapshot(runtime) -> _Snapshot:
    s = runtime.cache.stats
    p = runtime.predictor.counters if runtime.predictor is not None else None
    # waiting for an in-flight read-ahead before reusing its slot is I/O wait too
    return _Snapshot(
        time.perf_counter(),
        s.hits,
        s.misses,
        runtime.cache.bytes_read,
        runtime.counters.io_wait_s + s.eviction_wait_s,
        s.expert_bytes_missed,
        (s.readahead_issued, s.readahead_used, s.readahead_wasted),
        (p.predicted, p.checked) if p is not None else (0, 0),
        (s.miss_copy_reads, s.miss_copy_bytes, s.upgrades, s.upgrade_bytes, s.miss_copy_hits),
    )


def _ratio(end: tuple[int, int], start: tuple[int, int]) -> float:
    checked = end[1] - start[1]
    return (end[0] - start[0]) / checked if checked else 0.0


def _prediction_stats(runtime, start: _Snapshot, first: _Snapshot, last: _Snapshot) -> dict:
    issued, used, wasted = (b - a for a, b in zip(start.read_ahead, last.read_ahead))
    return {
        "predict_next": runtime.predictor is not None,
        "readahead_issued": issued,
        "readahead_used": used,
        "readahead_wasted": wasted,
        "prediction_accuracy": _ratio(last.predicted, start.predicted),
        "decode_prediction_accuracy": _ratio(last.predicted, first.predicted),
    }


def _stats(runtime, prompt_tokens: int, generated: int, start: _Snapshot, marks: list[_Snapshot]) -> GenerationStats:
    cache = runtime.cache
    first, last = marks[0], marks[-1]
    decode_tokens = len(marks) - 1
    decode_lookups = (last.hits - first.hits) + (last.misses - first.misses)
    hits, misses = last.hits - start.hits, last.misses - start.misses
    return GenerationStats(
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        prefill_s=first.t - start.t,
        decode_s=last.t - first.t,
        decode_tokens_per_s=decode_tokens / (last.t - first.t) if decode_tokens else 0.0,
        expert_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        decode_expert_hit_rate=(last.hits - first.hits) / decode_lookups if decode_lookups else 0.0,
        expert_hits=hits,
        expert_misses=misses,
        bytes_read=last.bytes_read - start.bytes_read,
        expert_bytes_missed=last.expert_bytes_missed - start.expert_bytes_missed,
        prefill_bytes_read=first.bytes_read - start.bytes_read,
        bytes_read_per_token=(last.bytes_read - first.bytes_read) / decode_tokens if decode_tokens else 0.0,
        io_wait_s=last.io_wait_s - start.io_wait_s,
        decode_io_wait_s=last.io_wait_s - first.io_wait_s,
        expert_cache_bytes=cache.memory_bytes,
        expert_cache_slots=cache.n_slots,
        working_set_bytes=cache.layout.working_set_bytes,
        io_threads=cache.io_threads,
        o_direct=cache.o_direct,
        layer_misses=dict(cache.stats.layer_misses),
        weight_bytes_per_token=runtime.dense_bytes_touched + decode_lookups * runtime.mean_expert_bytes / decode_tokens
        if decode_tokens
        else 0.0,
        latent_attention=runtime.latent_attention,
        kv_cache_bytes_per_token=runtime.kv_cache_bytes_per_token,
        kv_dtype=runtime.kv_dtype,
        **_prediction_stats(runtime, start, first, last),
        **_miss_copy_stats(runtime, start, last),
    )


def _miss_copy_stats(runtime, start: _Snapshot, last: _Snapshot) -> dict:
    reads, nbytes, upgrades, upgrade_bytes, hits = (b - a for a, b in zip(start.miss_copy, last.miss_copy))
    return {
        "miss_copy_bits": runtime.miss_copy_bits,
        "miss_copy_reads": reads,
        "miss_copy_bytes_read": nbytes,
        "upgrades": upgrades,
        "upgrade_bytes_read": upgrade_bytes,
        "miss_copy_hits": hits,
    }
