"""One thread owns the model: each step it admits waiting requests (a prefill each, alone), then decodes every
running sequence in one forward, so each MoE layer looks up the union of the batch's experts once per step.

Admission is first come, first served, bounded by `max_batch` rows and by the KV budget. A padded batch of B rows
of L positions holds B x L x (KV bytes per position). Reservations grow with the sequences: a request joins when
(B + 1) x the longest reach stays within the budget, where a sequence's reach is the positions it may hold
`kv_headroom` steps from now (capped at its prompt + max_tokens), so a long request does not hold back short ones
for the positions it has yet to use. Before each decode step, if B x (L + 1) would exceed the budget, the newest
sequence is preempted: its KV is dropped and it waits at the head of the queue, to be prefilled again with its
prompt and the tokens it has so far once there is room (its sampler and its text carry on). A lone sequence always
fits: one whose own prompt + max_tokens exceeds the budget is refused before it is queued (`check_fits`). At most
`max_queue` requests wait; more are refused (429) at once.

A prompt is prefilled in one forward, as `generate` runs it, or with `prefill_chunk` that many positions per
forward (`serve --memory`: what its warm-up measured then bounds every forward, whatever the prompt's length).

With an expert cache smaller than the model, a third bound (`ExpertCacheFit`): a row joins only while the batch's
expected distinct experts per step fit the cache's slots. A step that needs more evicts, within the step, what the
next step needs again, and every step rereads most of its experts (docs/serving.md, "The batch and the expert
cache", has what that costs).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque

import torch
from transformers.cache_utils import DynamicCache

from weightstream.engine.batching.batch import DecodeBatch
from weightstream.engine.batching.logprobs import TokenLogprob, score
from weightstream.engine.batching.sequence import Sequence
from weightstream.engine.kv_cache import quiet_cache_kwarg, stored_cache

KV_HEADROOM = 64  # positions past its current length that admission reserves for each sequence
PROMPT_CHUNK = 512  # positions per forward when a prompt is scored: its logits are held one chunk at a time
RETRY_AFTER_S = 1  # what a 429 for a full queue tells the client to wait


class Refused(Exception):
    """A request the scheduler will not take: `status` is the HTTP status, the message says what to do."""

    def __init__(self, message: str, status: int, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


class ExpertCacheFit:
    """Whether a decode batch of `rows` rows is expected to fit an expert cache of `slots` slots: rows x
    `per_row` (MoE layers x top-k) x the union ratio (distinct / choices) measured at the largest batch size seen
    below `rows` (1 before any), at most `slots`. Union ratios fall as batches grow, so the estimate errs towards
    smaller batches. `union_ratio(b)` gives the measured ratio at batch size b or below (a `StepRecorder`)."""

    def __init__(self, slots: int, per_row: int, union_ratio):
        self.slots, self.per_row, self.union_ratio = slots, per_row, union_ratio

    def __call__(self, rows: int) -> bool:
        return rows <= 1 or rows * self.per_row * self.union_ratio(rows - 1) <= self.slots

    def largest(self, limit: int) -> int:
        """The largest batch, up to `limit`, expected to fit now."""
        rows = 1
        while rows < limit and self(rows + 1):
            rows += 1
        return rows


class Scheduler:
    """Runs submitted sequences to completion on `model`; `hooks` see each step (routing replay, step records);
    `expert_fit` (an `ExpertCacheFit`, or None for no such bound) caps the batch by the expert cache; `max_queue`
    bounds the requests waiting for admission; `kv_headroom` is what admission reserves past a sequence's length;
    `prefill_chunk` (None: a prompt in one forward) the positions a prefill runs per forward; `prompt_chunk` bounds
    it for a prompt to score, whose every position's logits a chunk holds."""

    def __init__(
        self,
        model,
        max_batch: int,
        kv_budget_bytes: int,
        kv_bytes_per_token: int,
        hooks=(),
        observer=None,
        expert_fit=None,
        max_queue: int = 128,
        kv_headroom: int = KV_HEADROOM,
        prompt_chunk: int = PROMPT_CHUNK,
        prefill_chunk: int | None = None,
    ):
        self.model, self.max_batch, self.expert_fit = model, max_batch, expert_fit
        self.kv_budget_bytes, self.kv_bytes_per_token = kv_budget_bytes, kv_bytes_per_token
        self.max_queue, self.kv_headroom, self.prompt_chunk = max_queue, kv_headroom, prompt_chunk
        self.prefill_chunk = prefill_chunk
        self.hooks, self.observer = list(hooks), observer
        self.batch = DecodeBatch()
        self.kv_bytes = 0  # the batch's KV bytes after the last step (read by metrics from other threads)
        self.preemptions = 0  # sequences sent back to the queue to make room (read by metrics)
        self.waiting: deque[Sequence] = deque()
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._queued = 0  # in the inbox or waiting: counted under the lock, so the bound holds across threads
        self._queue_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.accepting = True
        self.drain_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="ws-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The scheduler's thread is running (a replica's health check asks)."""
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.batch)

    @property
    def queued(self) -> int:
        return self._queued

    def check_fits(self, kv_tokens: int) -> None:
        """Refuse (400) a request whose own KV reservation exceeds the whole budget: it could never run."""
        need = kv_tokens * self.kv_bytes_per_token
        if need > self.kv_budget_bytes:
            mib = 2**20
            raise Refused(
                f"prompt + max_tokens = {kv_tokens} tokens need {need / mib:.1f} MiB of KV cache; this server's KV "
                f"budget is {self.kv_budget_bytes / mib:.1f} MiB ({self.kv_budget_bytes // self.kv_bytes_per_token} "
                "tokens): ask for fewer max_tokens or a shorter prompt, or start the server with a larger --kv-cache",
                400,
            )

    def submit(self, *seqs: Sequence) -> None:
        """Queue sequences (one request's choices), all or none; their events arrive through their emit callbacks.
        Thread-safe."""
        if not self.accepting:
            raise Refused("the server is shutting down; retry on another instance", 503)
        for seq in seqs:
            self.check_fits(seq.kv_tokens)
        with self._queue_lock:
            if self._queued + len(seqs) > self.max_queue:
                raise Refused(
                    f"{self._queued} sequences are already waiting for a place in the batch and this request adds "
                    f"{len(seqs)}, more than this server queues (--max-queue {self.max_queue}); retry after "
                    f"{RETRY_AFTER_S} s (Retry-After), or send it to another instance",
                    429,
                    "queue_full",
                    RETRY_AFTER_S,
                )
            self._queued += len(seqs)
        for seq in seqs:
            self._inbox.put(seq)
        self._wake.set()

    def drain(self, grace_s: float) -> None:
        """Take no new requests; those in flight may finish within `grace_s`, then they are failed (503)."""
        self.accepting = False
        self.drain_deadline = time.monotonic() + grace_s
        self._wake.set()

    def stop(self) -> None:
        """End the thread; whatever is still queued or running is failed (503)."""
        self.accepting, self._stop = False, True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._fail_all("the server stopped before this request finished")

    def _run(self) -> None:
        while not self._stop:
            self._take_arrivals()
            self._drop_cancelled()
            if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                self._fail_all("the server is shutting down; this request did not finish within the shutdown grace")
            self._admit()
            if self.batch.seqs:
                self._make_room()
                self._guarded(self.batch.seqs, self._decode_step)
            else:  # idle: a submit wakes us; the timeout only bounds how late a drain deadline is noticed
                self._wake.wait(0.05)
                self._wake.clear()
            self.kv_bytes = self.batch.kv_bytes()

    def _take_arrivals(self) -> None:
        while True:
            try:
                self.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _unqueue(self, n: int = 1) -> None:
        with self._queue_lock:
            self._queued -= n

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._unqueue()
            self._ended(seq, "cancelled")
        gone = {s.id for s in self.batch.seqs if s.cancelled}
        for seq in [s for s in self.batch.seqs if s.id in gone]:
            self._ended(seq, "cancelled")
        self.batch.leave(gone)

    def _reach(self, seq: Sequence) -> int:
        """Positions `seq` may hold `kv_headroom` steps from now: what admission reserves for it."""
        return min(seq.kv_tokens, len(seq.prompt_ids) + len(seq.generated) + self.kv_headroom)

    def _fits(self, seq: Sequence) -> bool:
        rows = len(self.batch) + 1
        longest = max(self._reach(s) for s in [*self.batch.seqs, seq])
        if rows > self.max_batch or rows * longest * self.kv_bytes_per_token > self.kv_budget_bytes:
            return False
        return self.expert_fit is None or self.expert_fit(rows)

    def _admit(self) -> None:
        while self.waiting and not self._stop and self._fits(self.waiting[0]):
            seq = self.waiting.popleft()
            self._unqueue()
            self._guarded([seq], self._prefill, seq)

    def _make_room(self) -> None:
        """Preempt the newest sequences until the step's padded KV, rows x (length + 1), fits the budget."""
        while len(self.batch) > 1 and (
            len(self.batch) * (self.batch.length + 1) * self.kv_bytes_per_token > self.kv_budget_bytes
        ):
            seq = self.batch.seqs[-1]  # rows are in the order they joined
            self.batch.leave({seq.id})
            self.waiting.appendleft(seq)
            with self._queue_lock:
                self._queued += 1
            self.preemptions += 1

    def _prefill(self, seq: Sequence) -> None:
        """The prompt alone through the model, as `generate` runs it (in `prefill_chunk` chunks as `generate` given
        the same chunk); the sequence then joins the batch. A preempted sequence comes back with its prompt and the
        tokens it has so far (a routing replay's cursor moves on). A prompt to score (echo with logprobs) runs in
        chunks of at most `prompt_chunk` whose every position's logits are kept."""
        cache = stored_cache(self.model)
        ids = seq.prompt_ids + seq.generated
        n = len(ids)
        scoring = seq.params.score_prompt and not seq.prompt_scored
        if seq.params.max_tokens == 0 and not scoring:  # an echo with nothing to compute
            seq.finish("length")
            self._ended(seq, "finished")
            return
        chunk = self.prefill_chunk or n
        start = time.perf_counter()
        logits = self._chunked_prefill(seq, ids, cache, min(chunk, self.prompt_chunk) if scoring else chunk, scoring)
        if self.observer is not None:
            self.observer.prefilled(n, time.perf_counter() - start, int(seq.params.max_tokens > 0))
        if seq.params.max_tokens == 0:
            seq.finish("length")
            self._ended(seq, "finished")
        elif seq.step(logits[0]):
            self._ended(seq, "finished")
        else:
            self.batch.join(seq, cache)

    def _chunked_prefill(
        self, seq: Sequence, ids: list[int], cache: DynamicCache, chunk: int, scoring: bool
    ) -> torch.Tensor:
        """Prefill `ids` `chunk` positions per forward; (1, V) logits of the last position. `scoring`: every
        position's logits of a chunk are kept, to score each token under the logits of the position before it."""
        top = seq.params.logprobs or 0
        scored = [TokenLogprob(ids[0], None, None)]
        for begin in range(0, len(ids), chunk):
            end = min(len(ids), begin + chunk)
            logits = self._forward(
                _inputs(ids[begin:end], begin, cache), [seq.id], [end - begin], all_positions=scoring
            )
            if scoring:
                targets = ids[begin + 1 : end + 1]
                scored += score(logits[: len(targets)], targets, top)
        if scoring:
            seq.scored_prompt(scored)
        return logits[-1:]

    def _decode_step(self) -> None:
        seqs = list(self.batch.seqs)
        start = time.perf_counter()
        logits = self._forward(self.batch.step_inputs(), [s.id for s in seqs], [1] * len(seqs), "decode")
        if self.observer is not None:
            self.observer.decoded(len(seqs), time.perf_counter() - start)
        gone = set()
        for row, seq in enumerate(seqs):
            cancelled = seq.cancelled  # read once: a client may go away while this loop runs
            try:
                finished = cancelled or seq.step(logits[row])
            except Exception as exc:  # this row's own sampling or text: it fails alone, the others keep their tokens
                self._fail([seq], "picking this request's next token failed", exc)
                gone.add(seq.id)
                continue
            if finished:
                gone.add(seq.id)
                self._ended(seq, "cancelled" if cancelled else "finished")
        self.batch.leave(gone)

    def _forward(
        self, inputs: dict, seq_ids: list[int], tokens: list[int], phase: str = "prefill", all_positions: bool = False
    ) -> torch.Tensor:
        """(rows, V) fp32 logits of each row's last position; with `all_positions`, (positions, V) of the one row."""
        for hook in self.hooks:
            hook.begin_step(seq_ids, tokens, phase)
        start = time.perf_counter()
        with torch.inference_mode(), quiet_cache_kwarg():
            out = self.model(**inputs, use_cache=True, logits_to_keep=0 if all_positions else 1)
        for hook in self.hooks:
            hook.end_step(time.perf_counter() - start)
        return out.logits[0].float() if all_positions else out.logits[:, -1, :].float()

    def _guarded(self, seqs: list[Sequence], step, *args) -> None:
        """Run a step; if the engine fails, fail the step's sequences (500) and keep serving the rest."""
        try:
            step(*args)
        except Exception as exc:  # an I/O error in an expert read, a bug: the requests get it, the server lives
            self._fail(list(seqs), "the engine failed on this request", exc)
            self.batch.leave({s.id for s in seqs})

    def _fail(self, seqs: list[Sequence], what: str, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        print(f"weightstream serve: {len(seqs)} request(s) failed: {what}: {reason}", file=sys.stderr)
        for seq in seqs:
            if not seq.done:
                seq.fail(f"{what}: {reason}", 500)
                self._ended(seq, "failed")

    def _fail_all(self, message: str) -> None:
        self._take_arrivals()
        for seq in list(self.waiting) + list(self.batch.seqs):
            seq.fail(message, 503)
            self._ended(seq, "shutdown")
        self._unqueue(len(self.waiting))
        self.waiting.clear()
        self.batch.leave({s.id for s in self.batch.seqs})

    def _ended(self, seq: Sequence, outcome: str) -> None:
        seq.done = True
        for hook in self.hooks:
            hook.end_sequence(seq.id)
        if self.observer is not None:
            self.observer.ended(seq, outcome)


def _inputs(ids: list[int], begin: int, cache: DynamicCache) -> dict:
    """Forward arguments for positions begin .. begin + len(ids) - 1 of one sequence, after `begin` in `cache`."""
    end = begin + len(ids)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, end, dtype=torch.long),
        "position_ids": torch.arange(begin, end).unsqueeze(0),
        "past_key_values": cache,
    }
