"""Every option the engine takes, in one object that checks itself: `load_streaming_model(path, config)`.

The CLI builds it from its flags (commands/common.py `engine_config`), `serve` and its Ray replicas carry it in
ServeSettings, and `--json` prints it (`to_dict`). Each check here needs the options alone; what needs the model
(a cache size given as a multiple of its working set) or the machine (a --memory larger than it) is checked where
those are known, in the loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from weightstream.cache.policies import POLICY_NAMES
from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER, check_cache_size
from weightstream.engine import EXPERT_SOURCES, SOURCE_ALIASES
from weightstream.engine.kernels.choice import check_kernel_name
from weightstream.engine.kv_cache import KV_DTYPES
from weightstream.engine.latent_attention import check_form as check_latent_form
from weightstream.errors import WeightstreamError
from weightstream.units import parse_size


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model.

    expert_cache: the cache's size (bytes, a size such as "2GiB", or a multiple of the working set such as "1.5x",
        the default when neither it nor `memory` is given); memory: the whole process's budget instead, the cache
        sized to fill it (engine/footprint.py), with `context` tokens of KV cache (default 4096, at most the model's
        positions) or `kv_cache_bytes` reserved, measured after a `warmup_tokens`-token prompt.
    io_threads, chunk_bytes, o_direct: the reader's threads, request size, and O_DIRECT (else buffered reads).
    policy, policy_options: the cache's eviction policy and its options ("pinned" takes `pinned_keys`).
    expert_source: "expert-cache" (ours) or "page-cache" (experts through mmap: the baseline).
    predict_next: read each next MoE layer's experts ahead, as guessed by its router.
    expert_kernel: "auto" (the lean kernel proven bitwise equal to eager at load) or a kernel's name.
    fuse: RMSNorms and the rotary embedding as one native op each (a float32-computing checkpoint of GGML blocks).
    warm_restart: read back the experts the cache held when this model last ran with it.
    miss_copy, upgrade_after: a miss computes with the expert's small copy; upgraded at its N-th hit (None: never).
    latent_attention: DeepSeek's attention "absorbed" (over the cached latent) or "expanded" (transformers' form).
    kv_dtype: the dtype DeepSeek's latent cache is stored in: "auto" (the model's), "float32", "float16" /
        "bfloat16" (half float32's bytes), or "q8_0" (34 bytes a 32 values, llama.cpp's -ctk q8_0); the absorbed form
        only for the last three (engine/kv_cache.py).
    """

    expert_cache: str | int | None = None
    io_threads: int = 4
    policy: str = "lru"
    chunk_bytes: int | None = None
    o_direct: bool = True
    policy_options: dict | None = None
    expert_source: str = "expert-cache"
    predict_next: bool = False
    expert_kernel: str = "auto"
    fuse: bool = True
    memory: str | int | None = None
    context: int | None = None
    kv_cache_bytes: int | None = None
    warmup_tokens: int = 32
    warm_restart: bool = False
    miss_copy: bool = False
    upgrade_after: int | None = DEFAULT_UPGRADE_AFTER
    latent_attention: str = "absorbed"
    kv_dtype: str = "auto"

    def __post_init__(self):
        source = SOURCE_ALIASES.get(self.expert_source, self.expert_source)  # the names before 0.2, kept
        if source not in EXPERT_SOURCES:
            raise WeightstreamError(
                f"--expert-source {self.expert_source!r}: choose one of {', '.join(EXPERT_SOURCES)}"
            )
        object.__setattr__(self, "expert_source", source)
        check_kernel_name(self.expert_kernel)
        check_latent_form(self.latent_attention)
        self._check_kv_dtype()
        if self.policy not in POLICY_NAMES:
            raise WeightstreamError(f"--policy {self.policy!r}: choose one of {', '.join(POLICY_NAMES)}")
        if self.io_threads < 1:
            raise WeightstreamError(f"--io-threads {self.io_threads}: need at least 1 I/O thread")
        if self.warmup_tokens < 1:
            raise WeightstreamError(f"warmup_tokens {self.warmup_tokens}: the warm-up needs at least 1 token")
        if self.upgrade_after is not None and self.upgrade_after < 1:
            raise WeightstreamError(f"--upgrade-after {self.upgrade_after}: give a number of hits (1 or more) or never")
        if self.expert_cache is not None:
            check_cache_size(str(self.expert_cache))  # a typo refused before anything loads
        self._check_source()
        self._check_memory()

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise WeightstreamError(f"--kv-dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        if self.kv_dtype not in ("auto", "float32") and self.latent_attention != "absorbed":
            raise WeightstreamError(
                f"--kv-dtype {self.kv_dtype} stores DeepSeek's latent cache for the absorbed attention; "
                "--latent-attention expanded runs transformers' form on the model's own dtype: drop one of the two"
            )

    def _check_source(self) -> None:
        if self.expert_source == "expert-cache":
            return
        if self.miss_copy:
            raise WeightstreamError(
                "--miss-copy reads small copies into the expert cache's slots and upgrades them there; --expert-source "
                "page-cache has no slots of our own (drop one of the two)"
            )
        if self.predict_next:
            raise WeightstreamError(
                "--predict-next needs --expert-source expert-cache: through the page cache there are "
                "no slots of our own to read ahead into"
            )
        if self.warm_restart:
            raise WeightstreamError("--warm-restart restores the expert cache; --expert-source page-cache has none")

    def _check_memory(self) -> None:
        if self.memory is None:
            return
        if self.expert_cache is not None:
            raise WeightstreamError(
                f"--memory {self.memory} and --expert-cache {self.expert_cache}: give one; --memory sizes the expert "
                "cache itself"
            )
        if self.expert_source == "page-cache":
            raise WeightstreamError(
                "--memory sizes the expert cache, and --expert-source page-cache has none: run the page-cache path "
                "under a memory cgroup instead (`weightstream bench --memory-limit`)"
            )
        parse_size(self.memory, what="--memory")

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_size(self.memory, what="--memory")

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The options as `--json` prints them (a pinned set as its number of experts)."""
        out = dataclasses.asdict(self)
        keys = (self.policy_options or {}).get("pinned_keys")
        if keys is not None:
            out["policy_options"] = {**self.policy_options, "pinned_keys": len(keys)}
        return out
