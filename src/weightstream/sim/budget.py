"""The memory budget `tune` divides: dense weights, KV cache for a context, the runtime's overhead, and experts.

What is left after the first three is the expert budget: the most an expert cache may hold, and the room the
kernel's page cache gets for expert pages on the page-cache path. Both count against a cgroup memory limit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from weightstream import native
from weightstream.cgroup import MARGIN_SHARE, margin_for
from weightstream.errors import WeightstreamError
from weightstream.store.facts import is_lazy_dense, kv_cache_bytes, smaller_latent_kv, ties_embeddings
from weightstream.units import GIB, MIB, format_bytes

# Peak resident memory beyond dense weights + expert cache + KV: the interpreter, torch and transformers (code
# and heap), the model's objects, activations and the reader's bookkeeping. Measured with `benchmarks/tune_proof.py
# overhead` (docs/tune.md), peak RSS less the checkpoint pages the process maps (an untied input embedding's unused
# rows never come in), 256-token prompt, 2026-12-04: 459 MiB on the 16-layer OLMoE-shaped model, 436 MiB on the
# 4-layer one; stated with 5% headroom. A budget adds what a cgroup charges beyond the resident set, the margin
# `--memory` keeps (`cgroup.margin_for`), so tune divides SIZE as `--memory SIZE` does. (It was 726 MiB, margin
# included, measured 660 in November before the engine stopped importing the simulator and trimmed its heap.)
RUNTIME_OVERHEAD_BYTES = 482 * MIB


@dataclass(frozen=True, slots=True)
class Budget:
    """Bytes by part for one memory limit; `expert_bytes` is what is left for experts (cache or page cache)."""

    memory_bytes: int
    dense_bytes: int
    kv_cache_bytes: int
    runtime_overhead_bytes: int
    working_set_bytes: int  # one decode token's experts as the cache holds them (the runtime's 1x)
    context_tokens: int
    lazy_dense_bytes: int = 0  # of dense_bytes, mapped but hardly ever touched, so not counted (`lazy_dense_bytes`)
    overhead_share: float = 0.0  # of memory_bytes, the part of runtime_overhead_bytes that grows with it (the margin)
    smaller_kv: str = ""  # how the KV cache could be kept smaller (DeepSeek's latent in float32: `--kv-dtype float16`)

    @property
    def resident_dense_bytes(self) -> int:
        """Dense bytes in memory while decoding: all of them but those that stay on disk."""
        return self.dense_bytes - self.lazy_dense_bytes

    @property
    def expert_bytes(self) -> int:
        return self.memory_bytes - self.resident_dense_bytes - self.kv_cache_bytes - self.runtime_overhead_bytes

    @property
    def min_memory_bytes(self) -> int:
        """The smallest memory limit whose expert budget holds one token's working set."""
        fixed = self.runtime_overhead_bytes - self.overhead_share * self.memory_bytes
        need = self.resident_dense_bytes + self.kv_cache_bytes + fixed + self.working_set_bytes
        return math.ceil(need / (1 - self.overhead_share))

    def check(self) -> None:
        """Raise a clear error when the expert budget is below one token's working set."""
        if self.expert_bytes >= self.working_set_bytes:
            return
        raise WeightstreamError(
            f"--memory {format_bytes(self.memory_bytes)} leaves {format_bytes(max(self.expert_bytes, 0))} for "
            f"experts after dense weights ({format_bytes(self.resident_dense_bytes)} in memory), the KV cache of "
            f"{self.context_tokens} tokens ({format_bytes(self.kv_cache_bytes)}) and the runtime "
            f"({format_bytes(self.runtime_overhead_bytes)}); one token's working set is "
            f"{format_bytes(self.working_set_bytes)}, so no expert cache fits. Use --memory "
            f"{self.min_memory_bytes / GIB:.2f}GiB or more (or a shorter --context{self.smaller_kv}); below that only "
            "the page cache (mmap) can run this model, reading most of every token's experts from disk"
        )

    def to_dict(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "dense_bytes": self.dense_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "runtime_overhead_bytes": self.runtime_overhead_bytes,
            "expert_bytes": self.expert_bytes,
            "lazy_dense_bytes": self.lazy_dense_bytes,
            "resident_dense_bytes": self.resident_dense_bytes,
            "working_set_bytes": self.working_set_bytes,
            "context_tokens": self.context_tokens,
        }


def lazy_dense_bytes(dense_nbytes: dict[str, int], tied: bool) -> int:
    """Dense bytes a process maps but hardly touches: the input embedding table where the output head is a tensor
    of its own (decode reads one row of it per token; a tied head reads all of it every token). Dense weights are
    loaded through safetensors' mmap, so the rows no token uses never come in: on gpt-oss-20b's shape 1.08 GiB
    of a 4 GiB limit's 2.36 GiB of dense weights, room for the expert cache or the page cache. Measured there
    (docs/benchmarks.md as of commit 8df4075): a 2.18 GiB slru cache ran under 4 GiB at 3.9 GiB peak RSS, 1.41x
    the tok/s of the 1.11 GiB cache the whole table's count allowed; and the page-cache model read the kernel's
    bytes to 3%."""
    return sum(n for name, n in dense_nbytes.items() if is_lazy_dense(name, tied))


def budget_of(
    config,
    memory_bytes: int,
    context: int,
    dense_nbytes: dict[str, int],
    working_set_bytes: int,
    activation_bytes: int,
    overhead: int | None = None,
) -> Budget:
    """The budget of a model: its transformers config (the KV cache's shape, a tied head), the bytes of each dense
    tensor, one token's working set as the cache holds it, and the bytes of one element of the dtype its attention
    computes in (what the KV cache holds). `overhead`: the runtime's, by default RUNTIME_OVERHEAD_BYTES and the
    margin of `memory_bytes`."""
    return Budget(
        memory_bytes,
        sum(dense_nbytes.values()),
        kv_cache_bytes(config.get_text_config(), context, activation_bytes),
        RUNTIME_OVERHEAD_BYTES + margin_for(memory_bytes) if overhead is None else overhead,
        working_set_bytes,
        context,
        lazy_dense_bytes(dense_nbytes, ties_embeddings(config)),
        MARGIN_SHARE if overhead is None else 0.0,
    )


def checkpoint_budget(mapped, memory_bytes: int, context: int, kv_bytes: float | None = None) -> Budget:
    """`budget_of` a checkpoint opened by `store.model.map_model`: dense tensors as stored, the working set from its
    layout, and the KV cache in the dtype the model is built and computes in (the checkpoint's; for a quantized
    checkpoint the manifest's activation dtype, never the int8 / uint8 of its experts' weights), or `kv_bytes` a
    value (`--kv-dtype`)."""
    layout = mapped.layout
    dense = {name: t.nbytes for name, t in layout.dense.items()}
    itemsize = kv_bytes or mapped.model.dtype.itemsize
    budget = budget_of(mapped.config, memory_bytes, context, dense, layout.working_set_bytes, itemsize)
    text = mapped.config.get_text_config()
    if getattr(text, "kv_lora_rank", None):
        q8_0_runs = native.has("quantize_q8_0")
        budget = dataclasses.replace(budget, smaller_kv=smaller_latent_kv(text, itemsize, q8_0_runs))
    return budget
