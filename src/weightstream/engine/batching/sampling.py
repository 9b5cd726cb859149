"""Per-request sampling: OpenAI's logit_bias and presence/frequency penalties on the request's own logits row, then
greedy at temperature 0 (or below GREEDY_BELOW), else temperature, transformers' top-p warper and a generator of
the request's own, so a seeded request samples the same tokens alone or in a batch.

Numerically safe for every temperature validation lets through: scores are shifted so their maximum is 0 before
they are divided by the temperature, so nothing overflows to +inf (dividing raw float32 logits by 1.5e-39 did, and
softmax then gave NaN)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import TopPLogitsWarper

GREEDY_BELOW = 1e-5  # temperatures under this pick the argmax, as vLLM does: their distribution is one-hot anyway


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What the request asked for; `max_tokens` is already resolved against the context and the KV budget (0: an
    echoed prompt scored, nothing generated). `logit_bias`: (token id, bias) pairs; the penalties apply to the
    tokens this completion generated so far. `logprobs`: report each generated token's logprob and its row's
    `logprobs` most likely tokens (None: none); `score_prompt`: the prompt's tokens' too (echo)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    score_prompt: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Picks one sequence's next token from its own logits row (V,); without bias or penalties, as `generate` would
    with the same settings. It counts the tokens it picks, for the penalties. The row passed in is never changed."""

    def __init__(self, params: SamplingParams):
        self.greedy, self.temperature = params.greedy, params.temperature
        self.top_p = TopPLogitsWarper(params.top_p) if not self.greedy and params.top_p < 1.0 else None
        bias = dict(params.logit_bias)  # a token given twice: the last bias wins
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.counts: dict[int, int] = {}  # token -> times picked, kept only when a penalty is set
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = None if self.greedy else torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        scores = self._adjusted(logits)
        if self.greedy:
            token = int(torch.argmax(scores))  # generate's greedy: argmax of the fp32 logits
        else:
            scores = (scores - scores.max()) / self.temperature  # the max is 0: no +inf, no NaN, for any T > 0
            if self.top_p is not None:
                scores = self.top_p(None, scores.unsqueeze(0))[0]
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=self.generator))
        if self.presence or self.frequency:
            self.counts[token] = self.counts.get(token, 0) + 1
        return token

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """logits + bias - (count x frequency_penalty + presence_penalty) on each token generated so far (OpenAI's
        formula), out of place: the row is a view of the batch's logits."""
        if not len(self.bias_ids) and not self.counts:
            return logits
        scores = logits.float().clone()
        if len(self.bias_ids):
            scores.index_add_(0, self.bias_ids, self.bias)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            scores.index_add_(0, ids, -(counts * self.frequency + self.presence))
        return scores
