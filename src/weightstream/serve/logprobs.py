"""Log probabilities as OpenAI's API reports them: the scheduler's TokenLogprob entries (engine/batching/logprobs.py,
which says what a logprob is) in completions' `{tokens, token_logprobs, top_logprobs, text_offset}` and chat's
`{"content": [{token, logprob, bytes, top_logprobs}]}`, with each token's text.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from weightstream.engine.batching.logprobs import TokenLogprob

INCOMPLETE = "\ufffd"


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
