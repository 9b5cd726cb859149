"""What each forward step did to the expert cache: per MoE layer, the distinct experts the step's tokens chose (the
union of the batch's choices) against the choices made (tokens x top-k), and the bytes it read.

distinct / choices is what batching can save: at 1 that step would read as much as its tokens run one by one,
below 1 the batch shares experts. Totals feed /metrics; with a log path every step is also one JSON line.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DecodeTotals:
    """Sums over decode steps, overall and per batch size."""

    steps: int = 0
    choices: int = 0  # per step and layer: batch x top-k, summed
    distinct: int = 0  # per step and layer: distinct experts chosen, summed
    by_batch: dict[int, list[int]] = field(default_factory=dict)  # batch -> [steps, choices, distinct]


class StepRecorder:
    """Scheduler hook and the runtime's routing observer at once: it sees the routing used, replayed or not."""

    def __init__(self, runtime, log_path: str | None = None):
        self.runtime = runtime
        self.totals = DecodeTotals()
        self._lock = threading.Lock()
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # closed in close()
        self._phase, self._rows, self._layers, self._seqs = "", 0, [], []
        self._before = (0, 0.0)

    def begin_step(self, seq_ids: list[int], tokens: list[int], phase: str) -> None:
        self._phase, self._rows, self._layers, self._seqs = phase, len(seq_ids), [], list(seq_ids)
        self._before = self._io()

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        self._layers.append((int(torch.unique(top_k_index).numel()), top_k_index.numel()))

    def end_step(self, seconds: float) -> None:
        distinct = sum(d for d, _ in self._layers)
        choices = sum(c for _, c in self._layers)
        if self._phase == "decode":
            with self._lock:
                self.totals.steps += 1
                self.totals.choices += choices
                self.totals.distinct += distinct
                row = self.totals.by_batch.setdefault(self._rows, [0, 0, 0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + choices, row[2] + distinct
        if self._log is not None:
            self._write(seconds, distinct, choices)

    def end_sequence(self, seq_id: int) -> None:
        pass

    def union_ratio(self, batch: int) -> float:
        """Distinct / choices over the decode steps of the largest batch size up to `batch` seen so far; 1.0 before
        any (every row's experts its own)."""
        with self._lock:
            seen = [b for b in self.totals.by_batch if b <= batch]
            if not seen:
                return 1.0
            _, choices, distinct = self.totals.by_batch[max(seen)]
            return distinct / choices if choices else 1.0

    def snapshot(self) -> DecodeTotals:
        with self._lock:
            t = self.totals
            return DecodeTotals(t.steps, t.choices, t.distinct, {b: list(r) for b, r in t.by_batch.items()})

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _io(self) -> tuple[int, float]:
        r = self.runtime
        return r.cache.bytes_read, r.counters.io_wait_s + r.cache.stats.eviction_wait_s

    def _write(self, seconds: float, distinct: int, choices: int) -> None:
        bytes_read, io_wait = (b - a for a, b in zip(self._before, self._io()))
        record = {
            "t": time.time(),
            "phase": self._phase,
            "batch": self._rows,
            "seqs": self._seqs,  # each gets one token from this step: their inter-token times come from the log
            "seconds": round(seconds, 6),
            "distinct_per_layer": [d for d, _ in self._layers],
            "choices_per_layer": [c for _, c in self._layers],
            "union_ratio": distinct / choices if choices else 0.0,
            "bytes_read": bytes_read,
            "io_wait_s": round(io_wait, 6),
        }
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()
