"""A token's log probability as the scheduler records it for a request that asks for logprobs.

A token's logprob is log_softmax of the model's float32 logits row that produced it, taken before the request's
sampling adjustments (logit_bias, penalties, temperature, top_p): what the model gives the token, whatever the
request then did with it (vLLM's default, `raw_logprobs`, makes the same choice; OpenAI's reference does not say).
With it come the `top` most likely tokens of that row. Their OpenAI shapes are serve/logprobs.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0  # OpenAI's stand-in for a probability of 0 (-inf is not JSON)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One token and its logprob, with the row's `top` (token, logprob) pairs, most likely first. The first token of
    an echoed prompt has no logprob (nothing precedes it): `logprob` and `top` are None."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


def score(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The logprob of tokens[i] under rows[i] (float32 logits, (k, V)), and each row's `top` most likely tokens."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1))[:, 0].tolist()
    if top:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [
        TokenLogprob(t, max(lp, FLOOR), tuple((i, max(v, FLOOR)) for i, v in row))
        for t, lp, row in zip(tokens, chosen, tops)
    ]
