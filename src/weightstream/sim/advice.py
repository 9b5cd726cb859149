"""`tune`'s answer from the searched configurations: the recommendation, page cache against expert cache, and the
equivalent advice for llama.cpp users (one line each, with its reason)."""

from __future__ import annotations

from dataclasses import dataclass

from weightstream.sim.budget import Budget
from weightstream.sim.tune import Config, ModelFacts
from weightstream.units import MIB, format_bytes

LRU_PREFERENCE = 0.01  # LRU within 1% of the best is recommended instead: no pinned set, no tuning knob
TIE = 0.10  # page cache and expert cache within 10% of each other: the model cannot tell them apart
GPU_RUNTIME_BYTES = 512 * MIB  # CUDA context and llama.cpp's compute buffers, a rough allowance


@dataclass(slots=True)
class Verdict:
    """Page cache against the best expert-cache configuration."""

    winner: str  # expert-cache, page-cache, tie or unknown
    ratio: float | None  # best expert-cache tok/s / page-cache tok/s
    line: str
    loses_up_to_bytes: int | None = None  # the largest expert cache predicted slower than the page cache


def candidates(configs: list[Config]) -> list[Config]:
    return [c for c in configs if not c.bound]


def recommend(configs: list[Config]) -> tuple[Config, str]:
    """The fastest predicted configuration (LRU when within 1% of it), with why; the fewest MiB read without speeds."""
    pool = [c for c in candidates(configs) if c.predicted_decode_tokens_per_s]
    if not pool:
        expert = [c for c in candidates(configs) if c.path == "expert-cache"]
        best = min(expert, key=lambda c: (round(c.mib_read_per_token, 3), -c.cache_bytes))
        return best, "fewest MiB read per token (no speed model for these configurations)"
    best = max(pool, key=lambda c: c.predicted_decode_tokens_per_s)
    reason = f"fastest predicted decode of {len(pool)} configurations"
    lru = [c for c in pool if c.policy == "lru"]
    if best.path == "expert-cache" and best.policy != "lru" and lru:
        top_lru = max(lru, key=lambda c: c.predicted_decode_tokens_per_s)
        if top_lru.predicted_decode_tokens_per_s >= (1 - LRU_PREFERENCE) * best.predicted_decode_tokens_per_s:
            return top_lru, (
                f"LRU within {LRU_PREFERENCE:.0%} of the fastest predicted ({best.policy}, "
                f"{best.predicted_decode_tokens_per_s:.2f} tok/s): the simpler policy, no pinned set to keep"
            )
    return best, reason


def verdict(configs: list[Config]) -> Verdict:
    """Which path is faster by the prediction, by how much, and up to which expert-cache size the page cache wins."""
    page = next(c for c in configs if c.path == "page-cache")
    expert = [c for c in candidates(configs) if c.path == "expert-cache" and c.predicted_decode_tokens_per_s]
    if page.predicted_decode_tokens_per_s is None or not expert:
        return Verdict("unknown", None, "page cache vs expert cache: not predicted (no page-cache calibration)")
    best = max(expert, key=lambda c: c.predicted_decode_tokens_per_s)
    ratio = best.predicted_decode_tokens_per_s / page.predicted_decode_tokens_per_s
    what = (
        f"best expert cache {best.policy} {format_bytes(best.cache_bytes)} {best.predicted_decode_tokens_per_s:.2f} "
        f"tok/s (hit {best.hit_rate:.0%}) vs page cache {page.predicted_decode_tokens_per_s:.2f} tok/s "
        f"(hit {page.hit_rate:.0%} with {format_bytes(page.cache_bytes)})"
    )
    losing = [c.cache_bytes for c in expert if _best_at(expert, c.cache_bytes) < page.predicted_decode_tokens_per_s]
    loses_up_to = max(losing) if losing else None
    smaller = (
        f"; an expert cache of {format_bytes(loses_up_to)} or less loses to it"
        if loses_up_to is not None and loses_up_to < best.cache_bytes
        else ""
    )
    if abs(ratio - 1) <= TIE:
        return Verdict("tie", ratio, f"a tie within the model's 10%: {what}{smaller}", loses_up_to)
    if ratio > 1:
        return Verdict("expert-cache", ratio, f"the expert cache wins ({ratio:.2f}x): {what}{smaller}", loses_up_to)
    line = f"the expert cache LOSES here ({ratio:.2f}x): {what}; mmap and the page cache are the better choice"
    return Verdict("page-cache", ratio, line, loses_up_to)


def _best_at(expert: list[Config], size: int) -> float:
    return max(c.predicted_decode_tokens_per_s for c in expert if c.cache_bytes == size)


def llamacpp_advice(
    facts: ModelFacts, budget: Budget, page: Config, gpu_memory: int | None, cpu_only_verdict: Verdict
) -> list[str]:
    """llama.cpp equivalents, one line each with the reason; what we cannot predict is said too."""
    layer_bytes = facts.n_experts * facts.expert_nbytes
    experts_total = facts.layers * layer_bytes
    room = budget.expert_bytes
    lines = []
    if experts_total <= room:
        lines.append(
            f"llama.cpp: plain mmap (its default): all {format_bytes(experts_total)} of experts fit in the "
            f"{format_bytes(room)} the memory leaves, so after the first pass nothing is read from disk"
        )
    else:
        lines.append(
            f"llama.cpp on the CPU: mmap alone (its default; no --mlock, no --no-mmap): the page cache holds "
            f"{format_bytes(room)} = {room / experts_total:.0%} of the {format_bytes(experts_total)} of experts; "
            f"simulated hit rate {page.hit_rate:.0%}, {page.mib_read_per_token:.0f} MiB read per token; llama.cpp "
            f"has no expert cache of its own for CPU experts, so this is what it gets"
        )
    if gpu_memory is not None:
        lines.append(_n_cpu_moe_line(facts, budget, gpu_memory, layer_bytes, room))
    else:
        lines.append("llama.cpp with a GPU: pass --gpu-memory SIZE to get the --n-cpu-moe layer count")
    if experts_total > room:
        lines.append(
            "llama.cpp with a Q4_0, Q4_K or IQ4_NL GGUF on the CPU: add --no-repack (llama-bench: --repack 0): "
            "by default it copies those weights into anonymous memory at load, which the page cache cannot give "
            "back, so a model larger than the memory is killed instead of streamed (docs/tune.md)"
        )
    lines.append(f"this engine's answer to the same question: {cpu_only_verdict.line}")
    lines.append(
        "not predicted: llama.cpp's own tok/s (its kernels, quantization and threads differ from this engine's); "
        "the bytes and hit rates above do not depend on the engine"
    )
    return lines


def _n_cpu_moe_line(facts: ModelFacts, budget: Budget, gpu_memory: int, layer_bytes: int, room: int) -> str:
    gpu_room = gpu_memory - budget.dense_bytes - budget.kv_cache_bytes - GPU_RUNTIME_BYTES
    if gpu_room < 0:
        return (
            f"llama.cpp with a GPU: {format_bytes(gpu_memory)} of GPU memory is less than the dense weights and KV "
            f"({format_bytes(budget.dense_bytes + budget.kv_cache_bytes)}) plus "
            f"{format_bytes(GPU_RUNTIME_BYTES)} for the CUDA context and buffers, so -ngl 99 does not fit and "
            "--n-cpu-moe cannot help: offload fewer layers (-ngl) or run on the CPU as above"
        )
    on_gpu = max(min(gpu_room // layer_bytes, facts.layers), 0)
    n_cpu = facts.layers - on_gpu
    cpu_bytes = n_cpu * layer_bytes
    if n_cpu == 0:
        return (
            f"llama.cpp with a GPU: -ngl 99 and no --n-cpu-moe: every layer's experts fit in {format_bytes(gpu_memory)}"
        )
    # with dense weights on the GPU, RAM keeps only the CPU layers' experts (and llama.cpp itself)
    ram_room = room + budget.dense_bytes
    fit = (
        f"they fit in the {format_bytes(ram_room)} of RAM left for the page cache, so after warm-up no disk reads"
        if cpu_bytes <= ram_room
        else f"they exceed the {format_bytes(ram_room)} of RAM left for the page cache, so mmap reads their misses "
        f"from disk every token (the page-cache row above bounds the hit rate)"
    )
    return (
        f"llama.cpp with a GPU: -ngl 99 --n-cpu-moe {n_cpu}: {format_bytes(gpu_memory)} of GPU memory holds the "
        f"dense weights and KV ({format_bytes(budget.dense_bytes + budget.kv_cache_bytes)}) plus the experts of "
        f"{on_gpu} layers ({format_bytes(layer_bytes)} each); the first {n_cpu} layers' experts "
        f"({format_bytes(cpu_bytes)}) stay on the CPU: {fit}"
    )
