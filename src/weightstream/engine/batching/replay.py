"""A routing trace replayed per prompt (serve's --routing-trace under Ray): a sequence replays the trace request its
prompt picks, so the same prompt reads the same experts on whichever replica serves it, and a benchmark that sends
the same prompts through two routers replays the same routing under both."""

from __future__ import annotations

import hashlib

import numpy as np

from weightstream.engine.routing import BatchRoutingReplay


def prompt_request(prompt_ids: list[int], requests: int) -> int:
    """The trace request a prompt replays: a hash of its token ids, modulo the trace's requests."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % requests


class PromptRoutingReplay(BatchRoutingReplay):
    """BatchRoutingReplay whose sequences start at their prompt's trace request (`assign`, before they are
    submitted) instead of at the n-th request in the order they started."""

    def assign(self, seq_id: int, prompt_ids: list[int]) -> None:
        self.cursors[seq_id] = self.request_starts[prompt_request(prompt_ids, len(self.request_starts))]

    def forget(self, seq_id: int) -> None:
        self.cursors.pop(seq_id, None)
