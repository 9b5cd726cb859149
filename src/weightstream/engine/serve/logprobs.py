"""Log probabilities as OpenAI's API reports them.

A token's logprob is log_softmax of the model's float32 logits row that produced it, taken before the request's
sampling adjustments (logit_bias, penalties, temperature, top_p): what the model gives the token, whatever the
request then did with it (vLLM's default, `raw_logprobs`, makes the same choice; OpenAI's reference does not say).
With it come the `top` most likely tokens of that row. The shapes: completions' `{tokens, token_logprobs,
top_logprobs, text_offset}`, chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

import torch

FLOOR = -9999.0  # OpenAI's stand-in for a probability of 0 (-inf is not JSON)
INCOMPLETE = "\ufffd"


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


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) map back from the character standing for each byte to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(slots=True, frozen=True)
class Piece:
    """A token as OpenAI shows it: its text, its bytes, and whether it is a special token (which answers leave out)."""

    text: str
    data: bytes
    special: bool


class TokenText:
    """Each token's text and bytes as OpenAI shows them: the token decoded alone (special tokens included); a token
    that holds part of a multi-byte character shows its bytes instead, as `bytes:\\xe2\\x80`. Bytes come from
    byte-level BPE's character map or a sentencepiece byte token (`<0xE2>`), else from the decoded text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = _byte_level_chars()
        self._special = frozenset(tokenizer.all_special_ids)
        self._seen: dict[int, Piece] = {}

    def __call__(self, token: int) -> Piece:
        if token not in self._seen:
            self._seen[token] = self._piece(token)
        return self._seen[token]

    def _piece(self, token: int) -> Piece:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        special = token in self._special
        if INCOMPLETE not in text:
            return Piece(text, text.encode(), special)
        raw = self.tokenizer.convert_ids_to_tokens(token) or ""
        byte_token = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw)
        if byte_token:
            data = bytes([int(byte_token.group(1), 16)])
        elif raw and all(c in self._byte_of for c in raw):
            data = bytes(self._byte_of[c] for c in raw)
        else:
            return Piece(text, text.encode(), special)
        try:
            return Piece(data.decode(), data, special)
        except UnicodeDecodeError:
            return Piece("bytes:" + "".join(f"\\x{b:02x}" for b in data), data, special)


class TextOffsets:
    """Where each of a choice's tokens starts in its text, in characters: the characters the tokens before it
    completed (a character split over tokens counts once it is whole; special tokens, which answers leave out,
    count none)."""

    def __init__(self):
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, piece: Piece) -> int:
        if piece.special:
            return self.chars
        at = self.chars
        pending = self._utf8.getstate()[0]  # bytes of a character still incomplete
        if pending and piece.data and not 0x80 <= piece.data[0] < 0xC0:  # not its continuation: they show as U+FFFD
            at += len(pending.decode("utf-8", "replace"))
        self.chars += len(self._utf8.decode(piece.data))
        return at


class CompletionLogprobs:
    """/v1/completions' `logprobs` object: `top_logprobs[i]` maps the `top` most likely tokens' texts, and always
    token i's own, to their logprobs (so up to top + 1 entries, as OpenAI documents); `text_offset[i]` is where
    token i starts in the choice's text (its echoed prompt included; `offsets` carries on over a stream's chunks)."""

    def __init__(self, text: TokenText):
        self.text = text

    def __call__(self, entries: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict:
        offsets = offsets or TextOffsets()
        tokens, logprobs, tops, starts = [], [], [], []
        for e in entries:
            piece = self.text(e.token)
            tokens.append(piece.text)
            logprobs.append(e.logprob)
            starts.append(offsets(piece))
            if e.top is None:
                tops.append(None)
                continue
            top = {}
            for t, lp in e.top:
                top.setdefault(self.text(t).text, lp)
            top.setdefault(piece.text, e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": starts}


class ChatLogprobs:
    """/v1/chat/completions' `logprobs` object: per token its text, logprob, UTF-8 bytes and the `top_logprobs`
    most likely tokens of its row (the token itself only if it is among them)."""

    def __init__(self, text: TokenText):
        self.text = text

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self.text(token)
        return {"token": piece.text, "logprob": logprob, "bytes": list(piece.data)}

    def __call__(self, entries: list[TokenLogprob], offsets: TextOffsets | None = None) -> dict:
        content = [
            {**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top or ()]}
            for e in entries
        ]
        return {"content": content, "refusal": None}
