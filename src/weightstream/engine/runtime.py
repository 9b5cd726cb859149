"""Per-model streaming state: the expert cache, routing hooks, and the counters behind `stats`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightstream.cache.expert_cache import ExpertSource
from weightstream.cache.policy import split_waves
from weightstream.clock.activity import Announcer
from weightstream.engine.experts import combine, expert_contribution, timed_wait
from weightstream.engine.predict import NextLayerPredictor
from weightstream.store.layout import ModelLayout


@dataclass(slots=True)
class EngineCounters:
    io_wait_s: float = 0.0
    expert_calls: int = 0


class StreamingRuntime:
    """Serves every experts module of one model from one ExpertCache."""

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
        contributions = {}
        args = (hidden_states, top_k_index, top_k_weights)
        for i, wave in enumerate(split_waves(top_k_index.reshape(-1).tolist(), self.cache.n_slots)):
            fetch = self.cache.fetch_layer(layer, wave)
            if i == 0 and self.predictor is not None:  # after this layer's demand reads, so they go first
                self._read_ahead_next(layer, hidden_states, wave)
            for expert in fetch.resident:  # no waiting: compute these while the misses are read
                contributions[expert] = expert_contribution(module, self.cache.params(layer, expert), *args, expert)
            for _ in fetch.missing:  # each late expert as soon as its own bytes are in
                expert = timed_wait(self.cache, fetch, self.counters)
                contributions[expert] = expert_contribution(module, self.cache.params(layer, expert), *args, expert)
        return combine(hidden_states, contributions)

    def _read_ahead_next(self, layer: int, hidden_states: torch.Tensor, wave: list[int]) -> None:
        guess = self.predictor.predict(layer, hidden_states)
        if guess is not None:
            self.cache.read_ahead(guess[0], guess[1], running={(layer, e) for e in wave})

    def close(self) -> None:
        self.cache.close()
