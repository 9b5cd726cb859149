"""Experts computed in other processes, each set by a shard that holds it in its own memory (issue 51).

A shard (`ExpertShard`) loads the model from the files it can reach with an expert cache of exactly the experts it
keeps, reads them once and computes their contributions to a layer for the rows a head sends it. Offered a list of
experts, hottest first, and a memory budget, it keeps the longest head of the list that fits beside what the process
already holds (measured, not estimated), inside a memory cgroup of that budget where the machine lets it make one.

The head (`ShardedExperts`) computes its own experts as the engine always does (read from disk through its cache:
the last resort), sends each layer's rows to the shards owning the chosen experts over a `ShardLink`, writes their
rows into the layer's contributions, and lets the native layer sum them in ascending expert order: the tokens are
bitwise those of one process holding every expert. Only for kernels that run a layer natively (the GGML-block
kernels, `fused`); the head's cache is never asked for an expert a live shard holds.

An expert may be held by two shards (sim/placement.py's `copies`: the hottest N get a second copy): the head computes
it on its home shard while that is live, else on the copy, and hides the copy not asked from that shard's request.
A shard that fails or does not answer in time costs latency, not answers: the head computes its experts from its own
reads for that layer, and for every later one those no live copy holds, until the link says the shard is back (Ray
restarts it; the link re-reads what it holds). sim/placement.py's `place` makes the plan, by heat where given
(`heat_from_trace`: a routing trace's counts); engine/shard_ray.py runs shards as Ray actors.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from weightstream import native
from weightstream.cache.policy import split_waves
from weightstream.engine.experts import arrivals, contribute_groups, empty_contributions
from weightstream.errors import WeightstreamError
from weightstream.sim.placement import heat_counts

Key = tuple[int, int]  # (layer, expert)
Request = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # layer, hidden rows, their top-k index and weights


class ShardDown(Exception):
    """A shard failed or did not answer; `ShardedExperts` computes its experts itself."""


def _confine(memory: int, name: str) -> tuple[object | None, str]:
    """This process moved into the memory cgroup `name` (made, or taken as it is where it exists: a restarted
    shard's) of `memory` bytes: (the cgroup, its path), or (None, why not)."""
    from weightstream.cgroup import MemoryCgroup

    try:
        group = MemoryCgroup.create(memory, name=name, unique=False)
        (group.path / "cgroup.procs").write_text(str(os.getpid()))
    except (WeightstreamError, OSError) as exc:
        return None, f"not confined: {exc}"
    return group, str(group.path)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class ExpertShard:
    """Keeps as many of `offered` (hottest first) as fit in `memory` bytes (None: all) and computes their rows; with
    `cgroup` (a name) and `memory`, first moves this process into a memory cgroup of that name and size."""

    def __init__(
        self,
        model_dir: str,
        offered: Sequence[Key],
        memory: int | None = None,
        io_threads: int = 2,
        cgroup: str | None = None,
        threads: int | None = None,
    ):
        from weightstream.cgroup import margin_for
        from weightstream.engine.config import EngineConfig
        from weightstream.engine.loader import load_streaming_model
        from weightstream.store.model import map_model

        self.pid, self.memory = os.getpid(), memory
        with contextlib.suppress(OSError):  # Ray starts workers at niceness 15: a shard computes on the head's path
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))  # Ray starts its workers with one
        offered = list(dict.fromkeys(tuple(k) for k in offered))
        layout = map_model(model_dir).layout
        unknown = [k for k in offered if k not in layout.experts]
        if unknown:
            raise WeightstreamError(f"expert shard: {model_dir} has no expert {unknown[0]} (layer, expert)")
        self.group, self.cgroup = (None, "not confined")
        if memory and cgroup:
            self.group, self.cgroup = _confine(memory, cgroup)
        slot = layout.slot_bytes
        # the cache's arena is mapped, not touched: what it costs is the experts read into it (at least one token's
        # slots, which a cache must have)
        slots = max(len(offered), len(layout.num_experts) * layout.top_k)
        config = EngineConfig(expert_cache=slots * slot, io_threads=io_threads)
        try:
            self.model = load_streaming_model(model_dir, config)
        except BaseException:
            self._leave_cgroup()
            raise
        self.runtime = self.model.weightstream
        try:
            self.base_bytes = _rss()  # the interpreter, torch, the model's skeleton: before any expert
            room = len(offered) if memory is None else (memory - margin_for(memory) - self.base_bytes) // slot
            self.keys = sorted(offered[: max(0, room)])
            self.kernels = {part.layer: part.kernel for part in self.runtime._parts.values()}
            self.by_layer: dict[int, list[int]] = {}
            for layer, expert in self.keys:
                self.by_layer.setdefault(layer, []).append(expert)
            for layer, experts in self.by_layer.items():
                if not getattr(self.kernels[layer], "fused", False):
                    raise WeightstreamError(
                        f"expert shard: layer {layer}'s experts run the {self.kernels[layer].name} kernel; shards "
                        "compute the native GGML-block kernels only: `weightstream quantize` the model first"
                    )
                fetch = self.runtime.cache.fetch_layer(layer, experts)
                for _ in fetch.missing:
                    self.runtime.cache.wait(fetch)
        except BaseException:
            self.close()  # its I/O threads and leases
            self._leave_cgroup()
            raise
        self.rows_served, self.compute_s = 0, 0.0

    def _leave_cgroup(self) -> None:
        """A shard that failed to start moves back to its parent cgroup and removes its own (an actor that ends is
        removed by the head: `shard_ray.remove_cgroups`)."""
        if self.group is not None:
            with contextlib.suppress(OSError):
                (self.group.path.parent / "cgroup.procs").write_text(str(os.getpid()))
                self.group.remove()

    def rows(self, request: Request) -> torch.Tensor:
        """The contributions (rows, hidden; float32) of this shard's experts among `request`'s choices: the
        (token, k) rows that chose one of them, in row-major order (`owned_rows`)."""
        start = time.perf_counter()
        layer, hidden_states, top_k_index, top_k_weights = request
        mine = owned_rows(top_k_index, self.by_layer.get(layer, []))
        experts = sorted(set(top_k_index[mine].tolist()))
        contrib = empty_contributions(hidden_states, top_k_index)
        if experts:
            cache = self.runtime.cache
            groups = (group for group, _ in arrivals(cache, layer, [experts], lambda s: None))
            contribute_groups(
                contrib, self.kernels[layer], cache, layer, hidden_states, top_k_index, top_k_weights, groups
            )
        out = contrib[mine]
        self.rows_served += len(out)
        self.compute_s += time.perf_counter() - start
        return out

    def resident(self) -> list[Key]:
        """The keys this shard holds."""
        return self.keys

    def report(self) -> dict:
        """What the shard holds and has done: pid, keys, bytes, the process's resident set, its cgroup."""
        return {
            "pid": self.pid,
            "experts": len(self.keys),
            "expert_bytes": len(self.keys) * self.runtime.layout.slot_bytes,
            "base_bytes": self.base_bytes,
            "rss_bytes": _rss(),
            "memory": self.memory,
            "cgroup": self.cgroup,
            "rows_served": self.rows_served,
            "compute_s": round(self.compute_s, 6),
        }

    def close(self) -> None:
        self.runtime.close()


def owned_rows(top_k_index: torch.Tensor, experts: Sequence[int]) -> torch.Tensor:
    """(tokens, top-k) bool: the rows whose expert is one of `experts`."""
    return torch.isin(top_k_index, torch.tensor(list(experts), dtype=top_k_index.dtype))


@dataclass(slots=True)
class LinkStats:
    """What the head sent a shard and got back (head side: the round trip includes the shard's compute)."""

    round_trips: int = 0
    round_trip_s: float = 0.0
    rows: int = 0  # (token, k) rows computed by the shard
    bytes_out: int = 0  # hidden rows, top-k index and weights sent
    bytes_in: int = 0  # contribution rows received
    failures: int = 0  # calls that failed or timed out
    fallback_rows: int = 0  # its rows the head computed while it was down
    up: bool = True
    readmitted: int = 0  # times it came back after failing


class ShardLink:
    """One shard as the head reaches it: `send` starts its `rows(request)`, `receive` waits for the answer (raising
    ShardDown), `alive` says (without blocking) whether a shard that failed answers again, `resident` its keys."""

    def send(self, request: Request):
        raise NotImplementedError

    def receive(self, handle, timeout_s: float) -> torch.Tensor:
        raise NotImplementedError

    def alive(self) -> list[Key] | None:
        """The keys a shard that failed holds once it answers again; None while it does not (never blocks)."""
        raise NotImplementedError

    def resident(self) -> list[Key]:
        raise NotImplementedError

    def report(self) -> dict:
        """`ExpertShard.report` of the shard."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalLink(ShardLink):
    """A shard in this process (tests; one machine without Ray): answers at once."""

    def __init__(self, shard: ExpertShard):
        self.shard = shard

    def send(self, request: Request):
        return self.shard.rows(request)

    def receive(self, handle, timeout_s: float) -> torch.Tensor:
        return handle

    def alive(self) -> list[Key] | None:
        return self.shard.resident()

    def resident(self) -> list[Key]:
        return self.shard.resident()

    def report(self) -> dict:
        return self.shard.report()


@dataclass
class ShardedExperts:
    """The head's side: which shard computes which (layer, expert), and a layer computed with their rows."""

    links: list[ShardLink]
    timeout_s: float = 60.0  # a shard that takes longer is taken as down for the layer
    delay_s: float = 0.0  # added once to each layer's round trip (benchmarks: a network's latency, injected)
    on_change: Callable[[], None] | None = None  # called when a shard goes down or comes back (the plan re-made)
    home: dict[Key, int] | None = None  # the shard each expert's own copy is on (copies elsewhere: `copies`)
    stats: list[LinkStats] = field(init=False)

    def __post_init__(self):
        self.stats = [LinkStats() for _ in self.links]
        self._change = False
        self.owned: list[dict[int, list[int]]] = [self._owned(link) for link in self.links]

    @staticmethod
    def _owned(link: ShardLink, keys: Sequence[Key] | None = None) -> dict[int, list[int]]:
        owned: dict[int, list[int]] = {}
        for layer, expert in sorted(tuple(k) for k in (link.resident() if keys is None else keys)):
            owned.setdefault(layer, []).append(expert)
        return owned

    def held(self) -> set[Key]:
        """The (layer, expert) keys live shards hold now."""
        return {
            (layer, e) for i, own in enumerate(self.owned) if self.stats[i].up for layer, es in own.items() for e in es
        }

    def _readmit(self) -> None:
        for i, link in enumerate(self.links):
            if self.stats[i].up:
                continue
            keys = link.alive()
            if keys is not None:  # a restarted shard may hold another share of what it was offered
                self.owned[i] = self._owned(link, keys)
                self.stats[i].up, self.stats[i].readmitted = True, self.stats[i].readmitted + 1
                self._change = True

    def _down(self, i: int, rows: int) -> None:
        """Shard `i` failed: the head computes its `rows` of this layer, and its experts (those no live copy holds)
        until it is back."""
        s = self.stats[i]
        s.up, s.failures, s.fallback_rows = False, s.failures + 1, s.fallback_rows + rows
        self._change = True

    def _settle(self) -> None:
        """`on_change` once a change is seen, with no call in flight (it may ask the live shards for reports)."""
        if self._change and self.on_change is not None:
            self._change = False
            self.on_change()

    def assign(
        self, layer: int, top_k_index: torch.Tensor, among: set[int] | None = None, to: set[int] | None = None
    ) -> dict[int, list[int]]:
        """Shard -> the chosen experts of `layer` (those `among`, if given) it computes: each expert a live shard
        (one of `to`, if given) holds to one of them. An expert held once goes to its shard; a replicated one to its
        home shard (`home`, the plan's own share) while that is live, else (or without `home`), busiest first, to the
        copy with the fewest rows so far. The rows of an expert no live copy holds count against its first copy that is
        down (the head computes them)."""
        rows = Counter(top_k_index.reshape(-1).tolist())
        owners: dict[int, list[int]] = {}
        for i, own in enumerate(self.owned):
            for e in own.get(layer, ()):
                if e in rows and (among is None or e in among):
                    owners.setdefault(e, []).append(i)
        load, out = [0] * len(self.links), {}
        for e in sorted(owners, key=lambda e: (len(owners[e]) > 1, -rows[e], e)):
            live = [i for i in owners[e] if self.stats[i].up and (to is None or i in to)]
            if not live:
                down = [i for i in owners[e] if not self.stats[i].up]
                self.stats[(down or owners[e])[0]].fallback_rows += rows[e]
                continue
            home = (self.home or {}).get((layer, e))
            i = home if home in live else min(live, key=lambda j: (load[j], j))
            out.setdefault(i, []).append(e)
            load[i] += rows[e]
        return out

    def compute_layer(self, kernel, source, layer, hidden_states, top_k_index, top_k_weights, io_wait):
        """The layer's combined expert output: the shards' rows asked for first, the head's own computed meanwhile,
        a failed shard's computed by the head after."""
        self._readmit()
        self._settle()
        chosen = set(top_k_index.reshape(-1).tolist())
        calls = []  # (shard, its experts here, its rows, how many, handle, start)
        pending = sorted(self.assign(layer, top_k_index).items())
        while pending:
            i, members = pending.pop(0)
            link = self.links[i]
            rows = owned_rows(top_k_index, members)
            n = int(rows.sum())
            tokens = rows.any(dim=1).nonzero().squeeze(1)  # only the tokens that chose one of them travel
            index = top_k_index[tokens]
            elsewhere = [e for e in self.owned[i].get(layer, ()) if e in chosen and e not in members]
            if elsewhere:  # copies it holds that another shard computes this time: hidden from it
                index = index.masked_fill(owned_rows(index, elsewhere), -1)
            request = (layer, hidden_states[tokens], index, top_k_weights[tokens])
            start = time.perf_counter()
            try:
                handle = link.send(request)
            except ShardDown:  # dead before it was asked: its experts to live copies not yet asked, else to the head
                self._down(i, 0)
                asked = {c[0] for c in calls} | {i}
                merged = dict(pending)
                unasked = set(range(len(self.links))) - asked
                for j, more in self.assign(layer, top_k_index, set(members), unasked).items():
                    merged[j] = sorted(merged.get(j, []) + more)
                pending = sorted(merged.items())
                continue
            self.stats[i].bytes_out += sum(t.nbytes for t in request[1:])
            calls.append((i, members, rows, n, handle, start))
        far = {e for _, members, *_ in calls for e in members}
        contrib = empty_contributions(hidden_states, top_k_index)
        here = [e for e in chosen if e not in far]
        self._compute_here(contrib, here, kernel, source, layer, hidden_states, top_k_index, top_k_weights, io_wait)
        if calls and self.delay_s:
            time.sleep(self.delay_s)
        late = []
        for i, members, rows, n, handle, start in calls:
            s = self.stats[i]
            try:
                answer = self.links[i].receive(handle, self.timeout_s)
                if answer.shape != (n, hidden_states.shape[-1]):  # restarted unseen, holding another share
                    raise ShardDown(f"shard {i} answered {tuple(answer.shape)} rows for {n}")
            except ShardDown:
                self._down(i, n)
                late += members
                continue
            took = time.perf_counter() - start
            s.round_trips, s.round_trip_s = s.round_trips + 1, s.round_trip_s + took
            s.rows, s.bytes_in = s.rows + len(answer), s.bytes_in + answer.nbytes
            contrib[rows] = answer
        self._compute_here(contrib, late, kernel, source, layer, hidden_states, top_k_index, top_k_weights, io_wait)
        self._settle()
        return native.moe_sum(contrib, top_k_index, hidden_states)

    @staticmethod
    def _compute_here(contrib, experts, kernel, source, layer, hidden_states, top_k_index, top_k_weights, io_wait):
        """`experts`' rows computed by the head from its own cache, looked up token by token as the engine does."""
        if not experts:
            return
        wanted = set(experts)
        lookups = [e for e in top_k_index.reshape(-1).tolist() if e in wanted]
        groups = (group for group, _ in arrivals(source, layer, split_waves(lookups, source.n_slots), io_wait))
        contribute_groups(contrib, kernel, source, layer, hidden_states, top_k_index, top_k_weights, groups)

    def report(self) -> list[dict]:
        """Per shard: what the head measured (round trips, bytes, rows, failures), and whether it is up."""
        out = []
        for i, s in enumerate(self.stats):
            row = asdict(s)
            row["shard"] = i
            row["experts"] = sum(len(v) for v in self.owned[i].values())
            row["round_trip_mean_us"] = round(1e6 * s.round_trip_s / s.round_trips, 1) if s.round_trips else None
            if s.up:  # what the shard says of itself: its compute time, its process's memory
                with contextlib.suppress(Exception):
                    own = self.links[i].report()
                    row["shard_compute_s"], row["shard_rss_bytes"] = own["compute_s"], own["rss_bytes"]
                    row["shard_compute_mean_us"] = (
                        round(1e6 * own["compute_s"] / s.round_trips, 1) if s.round_trips else None
                    )
            out.append(row)
        return out

    def close(self) -> None:
        for link in self.links:
            link.close()


def heat_from_trace(path: str, layout) -> dict[Key, float]:
    """(layer, expert) -> its lookups in the routing trace at `path`, model routed layer i counted from the trace's
    layer i (wrapping, as replay does)."""
    from weightstream.trace import load
    from weightstream.trace.remap import token_rows

    trace = load(path)
    n_model = min(layout.num_experts.values())
    if trace.shape.n_experts > n_model:
        raise WeightstreamError(
            f"--shard-heat {path}: the trace has {trace.shape.n_experts} experts a layer, this model {n_model}; "
            "give a trace of this model (`weightstream trace record`) or of one with at most as many experts"
        )
    heat = heat_counts(token_rows(trace), layout.layers, n_model)
    return {key: count for key, count in heat.items() if key in layout.experts}
