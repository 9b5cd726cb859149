"""The runtime expert cache: a hard byte budget of slots, one expert of one layer per slot, filled by O_DIRECT."""

from __future__ import annotations

import ctypes
import os
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from weightstream.cache.inflight import InFlightReadAheads
from weightstream.cache.policies import make_policy
from weightstream.cache.policy import AllPinnedError, Key, LayerAccess, access_layer, insert_read_ahead
from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER
from weightstream.cache.slot_plan import SlotPlan, plan_slot
from weightstream.errors import WeightstreamError
from weightstream.io.aligned import AlignedArena
from weightstream.io.reader import DEMAND, READ_AHEAD, DirectReader, ReadBatch, ReadRequest
from weightstream.store.layout import ModelLayout
from weightstream.units import format_bytes


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was built; the engine's stats are read from here."""

    hits: int = 0
    misses: int = 0
    expert_bytes_missed: int = 0  # the missed experts' own bytes
    aligned_bytes_missed: int = 0  # what O_DIRECT must fetch for them: their 4 KiB-aligned spans
    layer_misses: dict[int, int] = field(default_factory=dict)
    readahead_issued: int = 0  # predicted experts whose reads were queued ahead of demand
    readahead_used: int = 0  # of those, demand-hit before being evicted
    readahead_wasted: int = 0  # of those, evicted before any demand lookup found them
    readahead_cancelled: int = 0  # of the wasted, evicted while still queued: their unread chunks were skipped
    readahead_aligned_bytes: int = 0  # what O_DIRECT would fetch for every read-ahead queued (cancelled or not)
    eviction_wait_s: float = 0.0  # time a lookup waited for an in-flight read-ahead it had to evict
    warm_issued: int = 0  # experts a warm restart queued into free slots at start (`ExpertCache.warm`)
    # --miss-copy: misses that read an expert's small copy, and what O_DIRECT fetched for them (counted in the
    # demand figures above too)
    miss_copy_reads: int = 0
    miss_copy_bytes: int = 0
    # --miss-copy: hits on a small copy, each read in full precision into its slot before the layer computed with it
    # (a demand read, counted in `aligned_bytes_missed` and `expert_bytes_missed`; the lookup is a hit)
    upgrades: int = 0
    upgrade_bytes: int = 0
    miss_copy_hits: int = 0  # --miss-copy with `upgrade_after` above 1: hits computed with the small copy, no read

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


class ExpertSource(Protocol):
    """Where the runtime gets experts from: this cache, or `engine.page_cache_source.PageCacheSource` (mmap)."""

    layout: ModelLayout
    stats: CacheStats
    n_slots: int  # experts it can hold at once
    memory_bytes: int  # memory of its own (0: the page cache holds the bytes)
    bytes_read: int  # bytes it read from the device itself
    io_threads: int
    o_direct: bool

    def fetch_layer(self, layer: int, experts: list[int]) -> LayerFetch:
        """Look up one layer's experts; the resident ones are usable now, each missing one arrives once."""

    def params(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's parameters in the model's layout (views, valid until the expert is evicted)."""

    def holds_small_copy(self, layer: int, expert: int) -> bool:
        """Whether `params` are the expert's small copy (`--miss-copy`), which its kernel's `small` computes."""

    def wait(self, fetch: LayerFetch) -> int:
        """Block until the next missing expert of `fetch` has all its bytes; returns it."""

    def close(self) -> None: ...


class ExpertCache:
    """Fixed-budget expert slots; the policy decides what stays, the reader fills what is missing.

    A slot's key is resident in the policy from the moment its read is queued. Demand reads of a layer are
    all awaited before the next layer; a read-ahead may still be landing, and `inflight` tracks those.

    With `miss_copy` (the checkpoint's `layout.small_copies`, `quantize --miss-bits`) a miss reads the expert's small
    copy into its slot instead, and the slot remembers it (`small`, with the hits it has had); the `upgrade_after`-th
    lookup that finds it there (default `cache.sizes.DEFAULT_UPGRADE_AFTER`, 8: the expert kept coming back while
    resident, so it is hot; None: never) reads the full blob into the same slot as a demand read, awaited like a miss
    before the layer computes with it, and the expert is full precision from then until evicted. Hits before that
    compute with the small copy.
    Read-aheads and a warm restart read full blobs. Slots keep the full blob's size.
    """

    def __init__(
        self,
        layout: ModelLayout,
        budget_bytes: int,
        policy: str = "lru",
        io_threads: int = 4,
        chunk_bytes: int | None = None,
        o_direct: bool = True,
        policy_options: dict | None = None,
        miss_copy: bool = False,
        upgrade_after: int | None = DEFAULT_UPGRADE_AFTER,
    ):
        if upgrade_after is not None and upgrade_after < 1:
            raise WeightstreamError(f"--upgrade-after {upgrade_after}: give 1 or more hits, or never")
        if miss_copy and not layout.small_copies:
            raise WeightstreamError(
                "--miss-copy reads each expert's small copy on a miss, and this checkpoint has none; write them with "
                "`weightstream quantize SRC --bits 4 --miss-bits 2 --out DIR`"
            )
        self.layout, self.slot_bytes = layout, layout.slot_bytes
        working_set = layout.working_set_bytes
        if budget_bytes < working_set:
            raise WeightstreamError(
                f"expert cache of {format_bytes(budget_bytes)} is below one token's working set of "
                f"{format_bytes(working_set)} for this model ({len(layout.num_experts)} MoE layers "
                f"x top-{layout.top_k} "
                f"x {format_bytes(self.slot_bytes)} per expert slot); use --expert-cache {working_set} (1x) or more"
            )
        self.n_slots = min(budget_bytes // self.slot_bytes, len(layout.experts))
        self.budget_bytes = budget_bytes
        self.policy = make_policy(
            policy, self.n_slots, working_set_slots=working_set // self.slot_bytes, **(policy_options or {})
        )
        self.arena = AlignedArena(self.n_slots * self.slot_bytes)
        kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        self.reader = DirectReader(self.arena, threads=io_threads, o_direct=o_direct, **kwargs)
        self.slot_of: dict[Key, int] = {}
        self._views: dict[Key, dict[str, torch.Tensor]] = {}  # params() of each key in a slot, until it leaves
        # sizes once, not a stat per miss: an aligned span is cut at the end of its file
        small = layout.small_copies if miss_copy else {}
        files = {p.path for e in (*layout.experts.values(), *small.values()) for p in e.pieces}
        file_sizes = {path: os.path.getsize(path) for path in files}
        self.plans: dict[Key, SlotPlan] = {key: plan_slot(e, file_sizes) for key, e in layout.experts.items()}
        self.small_plans: dict[Key, SlotPlan] = {key: plan_slot(e, file_sizes) for key, e in small.items()}
        assert all(p.slot_bytes <= self.slot_bytes for p in self.small_plans.values()), "a small copy outgrows a slot"
        self.miss_copy, self.upgrade_after = miss_copy, upgrade_after
        self.small: dict[Key, int] = {}  # keys whose slot holds (or is being filled with) the small copy -> its hits
        self.reader.open_files(sorted(file_sizes))  # at load, not at the first miss of each file
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.stats = CacheStats()
        self.inflight = InFlightReadAheads()
        self.unused_read_aheads: dict[Key, ReadBatch] = {}  # read ahead, not yet found by a demand lookup
        self.heat: dict[Key, int] = {}  # lookups of each expert since the cache was built (or its state restored)
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
    def o_direct(self) -> bool:
        return not self.reader.buffered_fallback

    def fetch_layer(self, layer: int, experts: list[int]) -> LayerFetch:
        """Look up a layer's experts (in order); queue reads for misses, gate projection first."""
        self._raise_if_failed()
        access = access_layer(self.policy, layer, experts)
        fetch = LayerFetch(layer, [], [e for _, e in access.misses], queue.SimpleQueue())
        # a batched step lists an expert once per token: later lookups hit, but its bytes may still be in flight
        for key in dict.fromkeys(access.hits):
            if key[1] in fetch.missing:
                continue
            if key in self.small:  # came back while its small copy is resident
                self.small[key] += 1
                if self.upgrade_after is not None and self.small[key] >= self.upgrade_after:
                    self._upgrade(key, fetch)  # hot: read in full before the layer computes with it
                    continue
                self.stats.miss_copy_hits += 1
            # a read-ahead still landing is awaited like a miss: readiness is observed once, here or on `arrived`
            (fetch.missing if self.inflight.listen(key, fetch.arrived) else fetch.resident).append(key[1])
        slots = [self.free.pop() for _ in range(len(access.misses) - len(access.evicted))]
        slots += [self._reclaim(victim) for victim in access.evicted]
        for key, slot in zip(access.misses, slots):
            self._assign(key, slot)
            if self.miss_copy:
                self.small[key] = 0
                self.stats.miss_copy_reads += 1
                self.stats.miss_copy_bytes += self.small_plans[key].aligned_bytes
            self._load(key, slot, lambda error, e=key[1]: fetch.arrived.put((e, error)), DEMAND)
        self._count_lookups(layer, access)
        return fetch

    def read_ahead(self, layer: int, experts: list[int], running: set[Key]) -> int:
        """Queue low-priority reads for the predicted `experts` of `layer` that are not resident; returns how many.

        Never evicts `running` (the layer being computed) or another predicted expert (the policy gets them as
        pinned) and stops when nothing else can go; a victim still being read is cancelled or awaited, never
        overwritten (see `_reclaim`).
        """
        if self._failed is not None:
            return 0
        keys = [(layer, int(e)) for e in experts]
        pinned = running | set(keys)
        issued = 0
        for key in keys:
            if key in self.policy:
                continue
            slot = self._read_ahead_slot(pinned)
            if slot is None:
                break
            insert_read_ahead(self.policy, key)
            self.unused_read_aheads[key] = self._load_in_background(key, slot)
            issued += 1
        self.stats.readahead_issued += issued
        return issued

    def warm(self, keys: list[Key], heat: dict[Key, int] | None = None) -> int:
        """Queue reads of `keys` (hottest first) into free slots at read-ahead priority, for a warm restart: never
        evicts, so it stays within the budget and a demand read always goes first; a lookup of a key still landing
        waits for it as for a read-ahead. The policy gets the keys coldest first, so it keeps the hottest longest.
        `heat` restores the lookup counts the next save starts from. Returns how many were queued."""
        if self._failed is not None:
            return 0
        chosen = [k for k in dict.fromkeys(keys) if k in self.plans and k not in self.policy][: len(self.free)]
        for key in reversed(chosen):
            self.policy.on_insert(key)
        for key in chosen:
            self._load_in_background(key, self.free.pop())
        self.heat.update({k: n for k, n in (heat or {}).items() if k in self.plans})
        self.stats.warm_issued += len(chosen)
        return len(chosen)

    def resident_by_heat(self) -> list[tuple[Key, int]]:
        """The experts in the cache now, with their lookup counts, hottest first (ties: layer, expert)."""
        return sorted(((k, self.heat.get(k, 0)) for k in self.slot_of), key=lambda kv: (-kv[1], kv[0]))

    def params(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's parameters, in the model's layout, as views of its slot (its small copy's, where it holds
        that: `holds_small_copy`)."""
        key = (layer, expert)
        out = self._views.get(key)
        if out is None:  # made once per stay in a slot: a decode step then costs no tensor ops here
            base = self.slot_of[key] * self.slot_bytes
            out = {}
            for name, offset, nbytes, shape, dtype in self._plan(key).views:
                out[name] = self.arena.tensor[base + offset : base + offset + nbytes].view(dtype).view(shape)
            self._views[key] = out
        return out

    def holds_small_copy(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.small

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

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise WeightstreamError(f"expert cache is unusable after an earlier read error: {self._failed}")

    def _count_lookups(self, layer: int, access: LayerAccess) -> None:
        for key in (*access.hits, *access.misses):
            self.heat[key] = self.heat.get(key, 0) + 1
        for key in access.hits:
            if self.unused_read_aheads.pop(key, None) is not None:
                self.stats.readahead_used += 1
        self.stats.hits += len(access.hits)
        self.stats.misses += len(access.misses)
        self.stats.layer_misses[layer] = self.stats.layer_misses.get(layer, 0) + len(access.misses)

    def _read_ahead_slot(self, pinned: set[Key]) -> int | None:
        """A free slot, or the slot of the policy's victim among unpinned experts; None when all are pinned."""
        if self.free:
            return self.free.pop()
        try:
            victim = self.policy.evict(pinned)
        except AllPinnedError:
            return None
        return self._reclaim(victim)

    def _reclaim(self, victim: Key) -> int:
        """The victim's slot, once no read is still landing in it (else that read would overwrite the new one)."""
        batch = self.unused_read_aheads.pop(victim, None)
        if batch is not None:
            self.stats.readahead_wasted += 1
            if victim in self.inflight:  # a wrong guess still queued: skip its unread chunks instead of waiting
                self.reader.cancel(batch)
                self.stats.readahead_cancelled += 1
        self.stats.eviction_wait_s += self.inflight.wait_landed(victim)
        self._views.pop(victim, None)
        self.small.pop(victim, None)
        return self.slot_of.pop(victim)

    def _upgrade(self, key: Key, fetch: LayerFetch) -> None:
        """Read `key`'s full blob over its small copy, into the same slot, awaited on `fetch` like a miss (nothing
        computes with the slot meanwhile: its small copy landed before the layer that read it computed)."""
        del self.small[key]
        self._views.pop(key, None)  # the small copy's views; `params` makes the full blob's once it has landed
        fetch.missing.append(key[1])
        self.stats.upgrades += 1
        self.stats.upgrade_bytes += self.plans[key].aligned_bytes
        self._load(key, self.slot_of[key], lambda error, e=key[1]: fetch.arrived.put((e, error)), DEMAND)

    def _plan(self, key: Key) -> SlotPlan:
        return self.small_plans[key] if key in self.small else self.plans[key]

    def _assign(self, key: Key, slot: int) -> None:
        assert key not in self.slot_of, key
        self.slot_of[key] = slot
        # every slot is either free or held by exactly one key: the byte budget stays hard
        assert len(self.slot_of) + len(self.free) <= self.n_slots, (len(self.slot_of), len(self.free))

    def _load_in_background(self, key: Key, slot: int) -> ReadBatch:
        """`key` into `slot` at read-ahead priority, tracked in flight so a lookup meanwhile waits for it."""
        self._assign(key, slot)
        self.inflight.start(key)
        return self._load(key, slot, lambda error: self._read_ahead_landed(key, error), READ_AHEAD)

    def _read_ahead_landed(self, key: Key, error: BaseException | None) -> None:
        if error is not None and self._failed is None:
            self._failed = error  # the next lookup reports it; a listener gets it through `arrived` too
        self.inflight.landed(key, error)

    def _load(self, key: Key, slot: int, notify: Callable[[BaseException | None], None], priority: int) -> ReadBatch:
        """Queue the reads of `key` into `slot`: its small copy where `small` holds it, else its blob."""
        plan = self._plan(key)
        base = slot * self.slot_bytes
        requests = [ReadRequest(path, offset, nbytes, base + dest) for path, offset, nbytes, dest in plan.requests]
        if priority == DEMAND:
            copies = self.layout.small_copies if key in self.small else self.layout.experts
            self.stats.expert_bytes_missed += copies[key].nbytes
            self.stats.aligned_bytes_missed += plan.aligned_bytes
        else:
            self.stats.readahead_aligned_bytes += plan.aligned_bytes

        def done(error: BaseException | None) -> None:
            if error is None:  # also after a cancel: the slot is then rewritten in full before any use
                for src, dst, nbytes in plan.packs:  # into the model's contiguous layout, where not usable in place
                    ctypes.memmove(self.arena.address + base + dst, self.arena.address + base + src, nbytes)
            notify(error)

        return self.reader.submit(requests, done, priority)
