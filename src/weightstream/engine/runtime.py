"""Per-model streaming state: the expert source, routing hooks, and the counters behind `stats`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weightstream.cache.expert_cache import ExpertSource
from weightstream.cache.policy import split_waves
from weightstream.clock.activity import Announcer
from weightstream.engine.experts import LayerRouting, compute_layer, compute_layer_native
from weightstream.engine.kernels.eager import Kernel
from weightstream.engine.predict import NextLayerPredictor
from weightstream.store.layout import ModelLayout

if TYPE_CHECKING:
    from weightstream.cache.warm import StateSaver
    from weightstream.engine.footprint import Footprint

# (layer, top_k_index, top_k_weights) -> (index, weights): the routing to run instead of the router's
RoutingOverride = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class EngineCounters:
    io_wait_s: float = 0.0
    expert_calls: int = 0
    expert_s: float = 0.0  # seconds inside `experts_forward`, routing hooks included


@dataclass(frozen=True, slots=True)
class ExpertsPart:
    """What one experts module of the model runs as: its MoE layer and the kernel it computes with."""

    layer: int
    kernel: Kernel


class StreamingRuntime:
    """Serves every experts module of one model from one expert source, each module through its kernel.

    Built whole by `engine.loader.load_streaming_model`. What changes afterwards goes through `swap_cache` (the
    expert source) and `replaying` (routing for a block), or the two hooks `routing_override` and
    `routing_observer`, which a caller sets for the runtime's life (a bench child, a server replaying a trace).
    """

    def __init__(
        self,
        cache: ExpertSource,
        layout: ModelLayout,
        parts: Mapping[torch.nn.Module, ExpertsPart],
        kernels: Mapping[str, str],
        predictor: NextLayerPredictor | None = None,
        fused: Sequence[str] = (),
        dense_bytes_touched: int = 0,
        footprint: Footprint | None = None,
        state_saver: StateSaver | None = None,
        miss_copy_bits: int = 0,
        latent_attention: str | None = None,
        kv_cache_bytes_per_token: int = 0,
        config=None,
        file_guard=None,
        kv_dtype: str | None = None,
    ):
        """`parts`: each experts module's layer and kernel; `kernels`: experts class name -> kernel name (for
        reports); `predictor`: read-aheads the next layer's guessed experts; `fused`: the norms and rotary functions
        that run as native ops (engine/fused.py); `dense_bytes_touched`: dense weight bytes one decode token
        multiplies by; `footprint`: the memory by part `--memory` sized the cache from; `state_saver`: saves the
        cache's contents for a warm restart, at intervals while decoding and at `close`; `miss_copy_bits`: the bits of
        the small copies a miss reads (`--miss-copy`; 0: exact mode, every expert computed as the checkpoint stores
        it); `latent_attention`: the form DeepSeek's latent attention runs in ("absorbed", "expanded"; None: the
        model has none); `kv_cache_bytes_per_token`: what a position costs in the KV cache, every layer (for
        DeepSeek's latent attention: (kv_lora_rank + qk_rope_head_dim) x the dtype a layer), `kv_dtype` that dtype's
        name; `config`: the
        EngineConfig it was loaded with; `file_guard`: the leases on the weight files (engine/file_guard.py), given
        up at `close`."""
        self._cache, self.layout = cache, layout
        self._parts = dict(parts)
        self.kernels = dict(kernels)
        self.predictor = predictor
        self.fused = list(fused)
        self.dense_bytes_touched = dense_bytes_touched
        self.footprint = footprint
        self.state_saver = state_saver
        self.miss_copy_bits = miss_copy_bits
        self.latent_attention = latent_attention
        self.kv_cache_bytes_per_token = kv_cache_bytes_per_token
        self.kv_dtype = kv_dtype
        self.config = config
        self.file_guard = file_guard
        self.counters = EngineCounters()
        # experts computed by shards in other processes (engine/shards.py's ShardedExperts; None: every expert here)
        self.shards = None
        self.first_layer = layout.layers[0]
        self.announce = Announcer.from_env()  # tells a listening `weightstream clockfloor` that decode is on
        self.routing_override: RoutingOverride | None = None
        # (layer, top_k_index, top_k_weights) -> None: records routing
        self.routing_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.mean_expert_bytes = sum(e.nbytes for e in layout.experts.values()) / max(1, len(layout.experts))

    @property
    def cache(self) -> ExpertSource:
        """The expert source every experts module is served from (`swap_cache` replaces it)."""
        return self._cache

    def swap_cache(self, source: ExpertSource) -> ExpertSource:
        """Serves from `source` from now on; returns the source served from until now, which the caller then owns
        (to close, or to swap back in)."""
        previous, self._cache = self._cache, source
        return previous

    @contextmanager
    def replaying(self, routing: RoutingOverride) -> Iterator[None]:
        """Within the block every experts module runs the routing `routing` returns instead of its router's; the
        override before it (None: the router's own) is back after."""
        previous, self.routing_override = self.routing_override, routing
        try:
            yield
        finally:
            self.routing_override = previous

    def experts_forward(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self._experts_forward(self._parts[module], hidden_states, top_k_index, top_k_weights)
        finally:
            self.counters.expert_s += time.perf_counter() - start

    def _experts_forward(self, part: ExpertsPart, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        layer = part.layer
        if layer == self.first_layer:
            self.announce.decode_step()
            if self.state_saver is not None:
                self.state_saver.tick()
        if self.routing_override is not None:
            top_k_index, top_k_weights = self.routing_override(layer, top_k_index, top_k_weights)
        if self.routing_observer is not None:
            self.routing_observer(layer, top_k_index, top_k_weights)
        self.counters.expert_calls += 1
        if self.predictor is not None:
            self.predictor.score(layer, top_k_index)
        lookups = top_k_index.reshape(-1).tolist()  # token by token
        waves = split_waves(lookups, self._cache.n_slots)
        read_ahead = (lambda wave: self._read_ahead_next(layer, hidden_states, wave)) if self.predictor else None
        kernel = part.kernel
        native_layer = getattr(kernel, "fused", False) and kernel.layer_fits(max(Counter(lookups).values()))
        if native_layer and self.shards is not None:  # else the head computes a shard's experts from its own reads
            return self.shards.compute_layer(
                kernel, self._cache, layer, hidden_states, top_k_index, top_k_weights, self._add_io_wait
            )
        if native_layer:
            return compute_layer_native(
                kernel,
                self._cache,
                layer,
                hidden_states,
                top_k_index,
                top_k_weights,
                waves,
                self._add_io_wait,
                read_ahead,
            )
        return compute_layer(
            kernel,
            self._cache,
            layer,
            hidden_states,
            LayerRouting(top_k_index, top_k_weights),
            waves,
            self._add_io_wait,
            read_ahead,
        )

    def _add_io_wait(self, seconds: float) -> None:
        self.counters.io_wait_s += seconds

    def _read_ahead_next(self, layer: int, hidden_states: torch.Tensor, wave: list[int]) -> None:
        guess = self.predictor.predict(layer, hidden_states)
        if guess is not None:
            self._cache.read_ahead(guess[0], guess[1], running={(layer, e) for e in wave})

    def close(self) -> None:
        if self.state_saver is not None:
            self.state_saver.close()
        self._cache.close()
        if self.file_guard is not None:
            self.file_guard.close()
