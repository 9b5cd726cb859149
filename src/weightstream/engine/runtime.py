"""Per-model streaming state: the expert cache, routing hooks, and the counters behind `stats`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightstream.cache.expert_cache import ExpertSource
from weightstream.cache.policy import split_waves
from weightstream.clock.activity import Announcer
from weightstream.engine.experts import LayerRouting, compute_layer, compute_layer_native
from weightstream.engine.predict import NextLayerPredictor
from weightstream.store.layout import ModelLayout


@dataclass(slots=True)
class EngineCounters:
    io_wait_s: float = 0.0
    expert_calls: int = 0


class StreamingRuntime:
    """Serves every experts module of one model from one expert source, each module through its kernel."""

    def __init__(self, cache: ExpertSource, layout: ModelLayout):
        self.cache, self.layout = cache, layout
        self.counters = EngineCounters()
        self.first_layer = layout.layers[0]
        self.announce = Announcer.from_env()  # tells a listening `weightstream clockfloor` that decode is on
        # (layer, top_k_index, top_k_weights) -> (index, weights): replays recorded routing instead of the router's
        self.routing_override: Callable | None = None
        # (layer, top_k_index, top_k_weights) -> None: records routing
        self.routing_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # set by load_streaming_model(predict_next=True): read-aheads the next layer's guessed experts
        self.predictor: NextLayerPredictor | None = None
        self.kernels: dict[str, str] = {}  # experts class -> kernel name (set by load_streaming_model)
        self.fused: list[str] = []  # norms and rotary functions run as native ops (engine/fused.py)
        self.dense_bytes_touched = 0  # dense weight bytes one decode token multiplies by (set by the loader)
        self.mean_expert_bytes = sum(e.nbytes for e in layout.experts.values()) / max(1, len(layout.experts))

    def experts_forward(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        layer = module._ws_layer
        if layer == self.first_layer:
            self.announce.decode_step()
        if self.routing_override is not None:
            top_k_index, top_k_weights = self.routing_override(layer, top_k_index, top_k_weights)
        if self.routing_observer is not None:
            self.routing_observer(layer, top_k_index, top_k_weights)
        self.counters.expert_calls += 1
        if self.predictor is not None:
            self.predictor.score(layer, top_k_index)
        lookups = top_k_index.reshape(-1).tolist()  # token by token
        waves = split_waves(lookups, self.cache.n_slots)
        read_ahead = (lambda wave: self._read_ahead_next(layer, hidden_states, wave)) if self.predictor else None
        kernel = module._ws_kernel
        if getattr(kernel, "fused", False) and kernel.layer_fits(max(Counter(lookups).values())):
            return compute_layer_native(
                kernel,
                self.cache,
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
            self.cache,
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
            self.cache.read_ahead(guess[0], guess[1], running={(layer, e) for e in wave})

    def close(self) -> None:
        self.cache.close()
