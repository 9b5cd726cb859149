"""One request's generation: its prompt, sampler, tokens so far, and the events it sends to whoever waits on it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightstream.engine.batching.logprobs import TokenLogprob, score
from weightstream.engine.batching.sampling import Sampler, SamplingParams
from weightstream.engine.batching.text import TextTail

_ids = itertools.count()


@dataclass(slots=True, frozen=True)
class Delta:
    """New text of the answer, and the logprobs of the tokens generated since the last Delta when the request asked
    for them (text released and tokens need not match: text waits for a whole character or a stop string's end)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True, frozen=True)
class PromptScored:
    """The prompt's tokens' logprobs (echo with logprobs), sent after the prefill and before any Delta; the first
    token's logprob is None."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(slots=True, frozen=True)
class Finished:
    """The answer is complete: `reason` is OpenAI's finish_reason ("stop" or "length")."""

    reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True, frozen=True)
class Failed:
    """The answer cannot be completed (server shutting down, engine error); `status` is the HTTP status to report."""

    message: str
    status: int


Event = Delta | PromptScored | Finished | Failed


class Sequence:
    """A request as the scheduler runs it. `cancel()` may be called from any thread; the rest is the scheduler's."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer,
        eos_ids: frozenset[int],
        emit: Callable[[Event], None],
    ):
        self.id = next(_ids)
        self.prompt_ids, self.params, self.eos_ids, self._emit = prompt_ids, params, eos_ids, emit
        self.sampler = Sampler(params)
        self.tail = TextTail(tokenizer, params.stop)
        self.generated: list[int] = []
        self.prompt_scored = False  # set once its prompt's logprobs are sent (a preempted sequence is not rescored)
        self.cancelled = False
        self.done = False
        self.finish_reason: str | None = None
        self.arrived_s = time.perf_counter()
        self.token_times: list[float] = []

    @property
    def kv_tokens(self) -> int:
        """KV cache positions this sequence may reach (prompt + max_tokens): its reservation's cap."""
        return len(self.prompt_ids) + self.params.max_tokens

    def cancel(self) -> None:
        """Stop at the next step boundary (client gone); sends nothing more. No-op once finished."""
        if not self.done:
            self.cancelled = True

    def step(self, logits: torch.Tensor) -> bool:
        """Pick the next token from this sequence's float32 logits row (V,) and take it; True when finished."""
        token = self.sampler(logits)
        top = self.params.logprobs
        return self.append(token, () if top is None else tuple(score(logits.unsqueeze(0), [token], top)))

    def scored_prompt(self, logprobs: list[TokenLogprob]) -> None:
        self.prompt_scored = True
        self.emit(PromptScored(tuple(logprobs)))

    def append(self, token: int, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        """Take the next token (and its logprobs), send the text it adds; True when the sequence is finished."""
        self.generated.append(token)
        self.token_times.append(time.perf_counter())
        delta, stopped = self.tail.push(self.generated)
        if token in self.eos_ids or stopped:
            return self.finish("stop", delta, logprobs)
        if len(self.generated) >= self.params.max_tokens:
            return self.finish("length", delta, logprobs)
        if delta or logprobs:
            self.emit(Delta(delta, logprobs))
        return False

    def finish(self, reason: str, delta: str = "", logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        delta += self.tail.finish()
        if delta or logprobs:
            self.emit(Delta(delta, logprobs))
        self.emit(Finished(reason, len(self.prompt_ids), len(self.generated)))
        self.finish_reason, self.done = reason, True
        return True

    def fail(self, message: str, status: int) -> None:
        self.emit(Failed(message, status))
        self.done = True

    def emit(self, event: Event) -> None:
        if not self.cancelled:
            self._emit(event)
