"""Per-request sampling: greedy at temperature 0, else transformers' own temperature and top-p warpers and a
generator of the request's own, so a seeded request samples the same tokens alone or in a batch."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What the request asked for; `max_tokens` is already resolved against the context and the KV budget."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks one sequence's next token from its own logits row (V,), as `generate` would with the same settings."""

    def __init__(self, params: SamplingParams):
        self.greedy = params.greedy
        self.warpers = [] if self.greedy else [TemperatureLogitsWarper(params.temperature)]
        if not self.greedy and params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if self.greedy else torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(torch.argmax(logits))  # generate's greedy: argmax of the fp32 logits
        scores = logits.unsqueeze(0)  # (1, V)
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator))
