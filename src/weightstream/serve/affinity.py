"""Expert affinity, the replica's side: the experts each prompt's prefill chose and the experts its cache holds, as a
replica reports them to a router that sends a prompt where its experts already are (weightstream/serve/ray/router.py).

A prompt is known by its affinity key, a hash of its first PREFIX_CHARS characters (a chat's roles and contents), so
the router computes it from the request body without a tokenizer, and prompts that share a long beginning (a
system prompt, a conversation so far) share a key. Expert sets travel as bitmaps over the model's (layer, expert)
keys in sorted order, hex-encoded: the replicas of one model share that order, and the router only intersects and
counts them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict

import torch

PREFIX_CHARS = 256  # a prompt's beginning that names it: long enough for a system prompt, short enough to share
KEPT_PROMPTS = 256  # prompts whose prefill experts a replica remembers (most recent first out of the report)
RESIDENT_REFRESH_S = 0.25  # how stale the reported resident set may be (it is read in the scheduler's thread)
AFFINITY_HEADER = "x-weightstream-affinity"  # the key, as the Ray ingress forwards it to the replica's HTTP app


def affinity_key(body: bytes | dict) -> str | None:
    """The affinity key of a completions or chat request body; None when it has no prompt text to key on."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            return None
    text = _prompt_text(body) if isinstance(body, dict) else ""
    if not text:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode("utf-8", "replace"), digest_size=8).hexdigest()


def _prompt_text(body: dict) -> str:
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}\x1f{_content(m.get('content'))}\x1e" for m in messages if isinstance(m, dict))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of prompts goes where its first one would
    if isinstance(prompt, list):
        return ",".join(str(token) for token in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content(content) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


class ExpertAffinity:
    """Scheduler hook and routing observer (wrapping `observer`, which still sees every layer): per affinity key the
    union of the experts its prefills chose, and the experts resident in the cache, for `report()`."""

    def __init__(self, runtime, observer=None, kept: int = KEPT_PROMPTS, clock=time.monotonic):
        self.runtime, self.observer, self.kept, self.clock = runtime, observer, kept, clock
        self.bit = {key: 1 << i for i, key in enumerate(sorted(runtime.layout.experts))}
        self._keys_of: dict[int, str] = {}  # sequence id -> its request's affinity key, until the sequence ends
        self._prefills: OrderedDict[str, int] = OrderedDict()  # key -> experts its prefills chose, least recent first
        self._step_key: str | None = None  # the key of the prefill step running now (scheduler thread only)
        self._step_bits = 0
        self._resident, self._resident_at = 0, float("-inf")
        self._lock = threading.Lock()

    def expect(self, seq_ids: list[int], key: str) -> None:
        """The sequences of one request, whose prefills are recorded under `key`. Any thread."""
        with self._lock:
            self._keys_of.update(dict.fromkeys(seq_ids, key))

    def forget(self, seq_ids: list[int]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._keys_of.pop(seq_id, None)

    def begin_step(self, seq_ids: list[int], tokens: list[int], phase: str) -> None:
        with self._lock:  # a prefill runs one sequence (or a chunk of its prompt)
            single = phase == "prefill" and len(seq_ids) == 1
            self._step_key, self._step_bits = (self._keys_of.get(seq_ids[0]) if single else None), 0

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(layer, top_k_index, top_k_weights)
        if self._step_key is not None:
            for expert in torch.unique(top_k_index).tolist():
                self._step_bits |= self.bit[(layer, expert)]

    def end_step(self, seconds: float) -> None:
        now = self.clock()
        resident = self._resident_bits() if now - self._resident_at >= RESIDENT_REFRESH_S else None
        with self._lock:
            if self._step_key is not None:
                self._prefills[self._step_key] = self._prefills.pop(self._step_key, 0) | self._step_bits
                while len(self._prefills) > self.kept:
                    self._prefills.popitem(last=False)
            if resident is not None:
                self._resident, self._resident_at = resident, now

    def end_sequence(self, seq_id: int) -> None:
        self.forget([seq_id])

    def _resident_bits(self) -> int:
        """The experts in the cache now (scheduler thread: nothing moves them meanwhile); 0 for a source that keeps
        no cache of its own (the page cache)."""
        bits = 0
        for key in getattr(self.runtime.cache, "slot_of", ()):
            bits |= self.bit[key]
        return bits

    def report(self) -> dict:
        """{"experts": how many (layer, expert) keys, "resident": bitmap, "prefills": {key: bitmap}}, hex strings.
        Any thread."""
        with self._lock:
            prefills = {key: format(bits, "x") for key, bits in self._prefills.items()}
            return {"experts": len(self.bit), "resident": format(self._resident, "x"), "prefills": prefills}
