"""Generated tokens to text, piece by piece, with stop strings: a piece is released only once no stop string can
still begin inside it, so a streamed answer never shows text that the final answer cuts."""

from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decoder shows for a multi-byte character whose last bytes are still to come


class TextTail:
    """The text of one sequence's generated ids: `push` returns the newly safe text and whether a stop string hit."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string could still need
        self.sent = ""  # text released so far
        self.text = ""  # the whole text so far (cut at a stop string once one is found)

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """(text newly safe to release, stopped) after the generated ids became `ids`."""
        self.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return self._release(len(self.text)), True
        end = len(self.text) - self.hold
        while end > 0 and self.text[end - 1] == INCOMPLETE:
            end -= 1
        return self._release(end), False

    def finish(self) -> str:
        """The rest of the text, once the sequence is over."""
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        # released text was checked while the hold kept back any place a stop string could still begin
        start = len(self.sent)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _release(self, end: int) -> str:
        # a tokenizer may re-decode earlier text differently (rare); then wait until it settles, never resend
        if end <= len(self.sent) or not self.text.startswith(self.sent):
            return ""
        piece = self.text[len(self.sent) : end]
        self.sent += piece
        return piece
