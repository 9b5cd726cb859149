"""The runtime expert cache: a hard byte budget of slots, one expert of one layer per slot, filled by O_DIRECT."""

from __future__ import annotations

import ctypes
import queue
from dataclasses import dataclass, field

import torch

from weightstream.cache.policies import make_policy
from weightstream.cache.policy import Key, access_layer
from weightstream.cache.sizes import format_bytes
from weightstream.errors import WeightstreamError
from weightstream.io.aligned import AlignedArena, aligned_bytes, region_bytes
from weightstream.io.reader import DEMAND, DirectReader, ReadRequest
from weightstream.store.layout import ExpertLayout, ModelLayout


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was built; the engine's stats are read from here."""

    hits: int = 0
    misses: int = 0
    expert_bytes_missed: int = 0  # the missed experts' own bytes
    aligned_bytes_missed: int = 0  # what O_DIRECT must fetch for them: their 4 KiB-aligned spans
    layer_misses: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(slots=True)
class LayerFetch:
    """One layer's lookups: `resident` experts are usable now; each `missing` one arrives once on `arrived`."""

    layer: int
    resident: list[int]
    missing: list[int]
    arrived: queue.SimpleQueue


class ExpertCache:
    """Fixed-budget expert slots; the policy decides what stays, the reader fills what is missing."""

    def __init__(self, layout: ModelLayout, budget_bytes: int, policy: str = "lru", io_threads: int = 4,
                 chunk_bytes: int | None = None, direct: bool = True, policy_options: dict | None = None):
        self.layout, self.slot_bytes = layout, layout.slot_bytes
        working_set = layout.working_set_bytes
        if budget_bytes < working_set:
            raise WeightstreamError(
                f"expert cache of {format_bytes(budget_bytes)} is below one token's working set of "
                f"{format_bytes(working_set)} for this model ({len(layout.num_experts)} MoE layers x top-{layout.top_k} "
                f"x {format_bytes(self.slot_bytes)} per expert slot); use --expert-cache {working_set} (1x) or more")
        self.n_slots = min(budget_bytes // self.slot_bytes, len(layout.experts))
        self.budget_bytes = budget_bytes
        self.policy = make_policy(policy, self.n_slots, working_set_slots=working_set // self.slot_bytes,
                                  **(policy_options or {}))
        self.arena = AlignedArena(self.n_slots * self.slot_bytes)
        kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        self.reader = DirectReader(self.arena, threads=io_threads, direct=direct, **kwargs)
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.stats = CacheStats()
        self._failed: BaseException | None = None

    @property
    def memory_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    @property
    def io_threads(self) -> int:
        return self.reader.threads

    @property
    def direct_io(self) -> bool:
        return not self.reader.buffered_fallback

    def fetch_layer(self, layer: int, experts: list[int]) -> LayerFetch:
        """Look up a layer's experts (in order); queue reads for misses, gate projection first."""
        if self._failed is not None:
            raise WeightstreamError(f"expert cache is unusable after an earlier read error: {self._failed}")
        access = access_layer(self.policy, layer, experts)
        missing = [e for _, e in access.misses]
        # a batched step lists an expert once per token: later lookups hit, but its bytes may still be in flight
        resident = [e for e in dict.fromkeys(e for _, e in access.hits) if e not in set(missing)]
        fetch = LayerFetch(layer, resident, missing, queue.SimpleQueue())
        first_evicting = len(access.misses) - len(access.evicted)
        for i, key in enumerate(access.misses):
            slot = self.free.pop() if i < first_evicting else self.slot_of.pop(access.evicted[i - first_evicting])
            assert key not in self.slot_of, key
            self.slot_of[key] = slot
            self._load(key, slot, fetch.arrived)
        self.stats.hits += len(access.hits)
        self.stats.misses += len(access.misses)
        self.stats.layer_misses[layer] = self.stats.layer_misses.get(layer, 0) + len(access.misses)
        return fetch

    def params(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's parameters, in the model's layout, as views of its slot."""
        base = self.slot_of[(layer, expert)] * self.slot_bytes
        out, offset = {}, base
        for param in self.layout.experts[(layer, expert)].params:
            out[param.name] = self.arena.tensor[offset:offset + param.nbytes].view(param.dtype).view(param.shape)
            offset += param.nbytes
        return out

    def wait(self, fetch: LayerFetch) -> int:
        """The next missing expert whose bytes have all arrived (each is returned exactly once)."""
        expert, error = fetch.arrived.get()
        if error is not None:
            self._failed = error
            if isinstance(error, WeightstreamError):
                raise error
            raise WeightstreamError(f"reading expert {expert} of layer {fetch.layer} failed: {error}") from error
        return expert

    def close(self) -> None:
        self.reader.close()

    def _load(self, key: Key, slot: int, arrived: queue.SimpleQueue) -> None:
        expert = self.layout.experts[key]
        base = slot * self.slot_bytes
        requests, dest = [], base
        for piece in expert.pieces:  # execution order: gate, up, down
            requests.append(ReadRequest(piece.path, piece.offset, piece.nbytes, dest))
            dest += region_bytes(piece.nbytes)
        self.stats.expert_bytes_missed += expert.nbytes
        self.stats.aligned_bytes_missed += sum(aligned_bytes(p) for p in expert.pieces)

        def done(error: BaseException | None) -> None:
            if error is None:
                self._pack(expert, base)
            arrived.put((key[1], error))

        self.reader.submit(requests, done, DEMAND)

    def _pack(self, expert: ExpertLayout, base: int) -> None:
        """Move each piece from where O_DIRECT landed it to its place in the model's contiguous layout."""
        src, dst = base, base
        for piece in expert.pieces:
            ctypes.memmove(self.arena.address + dst, self.arena.address + src + piece.offset % 4096, piece.nbytes)
            src += region_bytes(piece.nbytes)
            dst += piece.nbytes
