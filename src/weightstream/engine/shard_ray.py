"""Expert shards as Ray actors (engine/shards.py's `ExpertShard`), reached through compiled graphs (issue 51).

Each shard is an actor that Ray restarts when its process dies (`max_restarts=-1`; it loads and reads its experts
again), reached through a compiled graph of its own (`experimental_compile`: shared-memory channels set up once, no
scheduler on the path; 2.3-9x cheaper a round trip than actor calls, docs/benchmarks.md) or, with
`transport="calls"`, plain actor calls. A graph whose shard died is torn down by Ray; the link is then down, the head
computes the shard's experts, and `alive()` polls the restarted actor without blocking and compiles a new graph
once it answers. A graph per shard, so that one shard's death leaves the others' graphs running.

`sharded` is the `--expert-shards` of generate and serve: Ray started here (or joined), the plan made and built,
the links handed to the model's runtime, all of it undone after.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from weightstream.engine.shards import ExpertShard, Key, ShardDown, ShardedExperts, ShardLink, heat_from_trace
from weightstream.errors import WeightstreamError
from weightstream.sim.placement import copies, place

POLL_S = 1.0  # a down shard is asked again at most this often
START_TIMEOUT_S = 900  # for the shards to load and read their experts
TRANSPORTS = ("graph", "calls")


@dataclass(frozen=True, slots=True)
class ShardOptions:
    """`--expert-shards` and its companions, as generate and serve take them."""

    shards: int
    memory: int | None = None  # --shard-memory: each shard's budget (and cgroup) in bytes; None: every offered expert
    heat_trace: str | None = None  # --shard-heat: a routing trace whose counts place the experts
    plan_out: str | None = None  # --shard-plan: where to save the plan (JSON)
    address: str | None = None  # --ray-address; None: a local cluster started here (unless Ray is running)
    transport: str = "graph"
    placement: str = "layers"  # --shard-placement: sim/placement.py's `place`
    timeout_s: float = 60.0
    io_threads: int = 2
    delay_us: float = 0.0  # --shard-delay-us: added to each layer's round trip (a network's latency, benchmarks)
    replicas: int = 0  # --shard-replicas: the hottest this many experts get a second copy on another shard


def _ray():
    try:
        import ray
    except ImportError:
        raise WeightstreamError(
            "--expert-shards runs the shards as Ray actors: install Ray with pip install 'weightstream[ray]'"
        ) from None
    return ray


class RayLink(ShardLink):
    """An `ExpertShard` actor, by compiled graph or actor calls."""

    def __init__(self, actor, keys: list[Key], transport: str = "graph"):
        """`keys`: what the actor answered it holds once built (`resident`)."""
        if transport not in TRANSPORTS:
            raise WeightstreamError(f"shard transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.ray, self.actor, self.transport = _ray(), actor, transport
        self.keys = [tuple(k) for k in keys]
        self.graph = self._compile() if transport == "graph" else None
        self._probe, self._probed_at = None, 0.0

    def _compile(self):
        from ray.dag import InputNode

        with InputNode() as request:
            node = self.actor.rows.bind(request)
        return node.experimental_compile()

    def send(self, request):
        try:
            return self.graph.execute(request) if self.graph is not None else self.actor.rows.remote(request)
        except Exception as exc:  # a torn-down graph, a dead actor: Ray raises several kinds
            self._drop_graph()
            raise ShardDown(str(exc)) from exc

    def receive(self, handle, timeout_s: float):
        try:
            return self.ray.get(handle, timeout=timeout_s)
        except Exception as exc:
            self._drop_graph()
            raise ShardDown(str(exc)) from exc

    def _drop_graph(self) -> None:
        if self.graph is not None:
            with contextlib.suppress(Exception):
                self.graph.teardown()
        self.graph = None

    def alive(self) -> list[Key] | None:
        now = time.monotonic()
        if self._probe is None:
            if now - self._probed_at < POLL_S:
                return None
            self._probe, self._probed_at = self.actor.resident.remote(), now
        ready, _ = self.ray.wait([self._probe], timeout=0)
        if not ready:
            return None
        probe, self._probe = self._probe, None
        try:
            keys = [tuple(k) for k in self.ray.get(probe)]
            if self.transport == "graph":
                self.graph = self._compile()
        except Exception:
            self._drop_graph()
            return None
        self.keys = keys
        return keys

    def resident(self) -> list[Key]:
        return self.keys

    def report(self) -> dict:
        return self.ray.get(self.actor.report.remote(), timeout=10)

    def close(self) -> None:
        self._drop_graph()
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor, no_restart=True)


def start_shards(
    model_dir: str, offered: list[list[Key]], options: ShardOptions, home: dict[Key, int] | None = None
) -> ShardedExperts:
    """One actor per list of `offered` (Ray must be initialised), each built and holding its share before this
    returns; the head's ShardedExperts over them."""
    ray = _ray()
    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(ExpertShard)
    session = f"weightstream-shard-{os.getpid()}-{int(time.time())}"
    actors = [
        actor.remote(model_dir, keys, options.memory, options.io_threads, f"{session}-{i}")
        for i, keys in enumerate(offered)
    ]
    try:  # built: an error in one is raised here, naming it
        held = ray.get([a.resident.remote() for a in actors], timeout=START_TIMEOUT_S)
        links = [RayLink(a, keys, options.transport) for a, keys in zip(actors, held)]
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise WeightstreamError(
                f"--expert-shards: the shards did not hold their experts within {START_TIMEOUT_S} s (a shard killed "
                "while loading, e.g. for memory, is restarted again and again); give them more --shard-memory"
            ) from None
        raise WeightstreamError(_shard_error(exc)) from None
    return ShardedExperts(links, timeout_s=options.timeout_s, delay_s=options.delay_us / 1e6, home=home)


def _shard_error(exc: BaseException) -> str:
    """The first line of what a shard raised in its constructor (Ray wraps it in its own errors)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, WeightstreamError):
            return str(seen)
        seen = getattr(seen, "cause", None) or getattr(seen, "creation_task_error", None) or seen.__cause__
    text = str(exc)
    found = text.find("WeightstreamError: ")
    if found >= 0:
        return text[found + len("WeightstreamError: ") :].splitlines()[0]
    return f"an expert shard failed to start: {text.splitlines()[0] if text else type(exc).__name__}"


def shard_cgroups(report: dict) -> set[str]:
    """The memory cgroups a plan's shards run in (paths; a shard without one says why instead)."""
    return {p for shard in report.get("shards", []) if (p := shard.get("cgroup") or "").startswith("/")}


def remove_cgroups(paths: set[str]) -> None:
    """The shards' memory cgroups removed, once their processes are gone (a few seconds at most)."""
    from pathlib import Path

    from weightstream.cgroup import MemoryCgroup

    for path in sorted(paths):
        MemoryCgroup(Path(path), True, 0).remove()


def plan(model, options: ShardOptions) -> tuple[list[list[Key]], dict[Key, int], str]:
    """Each shard's offered experts (its own share hottest first, then its copies of others'), the shard each expert's
    own copy is on, and where the heat came from."""
    layout = model.weightstream.layout
    heat = heat_from_trace(options.heat_trace, layout) if options.heat_trace else None
    source = f"routing trace {options.heat_trace}" if heat else "none (every expert alike)"
    own = place(sorted(layout.experts), options.shards, heat, options.placement)
    extra = copies(own, options.replicas, heat)
    home = {key: i for i, keys in enumerate(own) for key in keys}
    return [a + b for a, b in zip(own, extra)], home, source


def plan_report(sharded: ShardedExperts, layout, heat_source: str, options: ShardOptions, strict: bool = True) -> dict:
    """The plan as it stands: each shard's experts, whether it is up, and (from a live one) its bytes, memory, cgroup
    and pid; the experts held twice; the experts the head reads from disk (no live shard holds them). `strict`: a live
    shard that does not report raises (at start); else it is listed without what it would have said."""
    shards, copies, home = [], {}, sharded.home or {}
    for i, link in enumerate(sharded.links):
        held = sorted(k for layer, es in sharded.owned[i].items() for k in ((layer, e) for e in es))
        for k in held:
            copies[k] = copies.get(k, 0) + 1
        up = sharded.stats[i].up
        report = {}
        if up and strict:
            report = link.report()
        elif up:
            with contextlib.suppress(Exception):  # it may die while asked
                report = link.report()
        guests = sum(1 for k in held if home.get(k, i) != i)  # copies of another shard's own experts
        shards.append({"shard": i, "up": up, **report, "copies": guests, "held": [list(k) for k in held]})
    head = sorted(set(layout.experts) - sharded.held())
    return {
        "shards": shards,
        "head_reads": [list(k) for k in head],  # not held by any live shard: the head's cache reads them from disk
        "replicated": sum(1 for n in copies.values() if n > 1),
        "heat": heat_source,
        "transport": options.transport,
        "placement": options.placement,
        "shard_memory": options.memory,
        "replicas": options.replicas,
    }


def summary(report: dict) -> str:
    """One line per shard and one for the head, for stderr."""
    lines = []
    for s in report["shards"]:
        lines.append(
            f"shard {s['shard']}: {len(s['held'])} experts{f' ({n} of them copies)' if (n := s.get('copies')) else ''} "
            f"({s.get('expert_bytes', 0) / 2**20:.0f} MiB) in pid {s.get('pid')}, {s.get('cgroup')}"
            if s["up"]
            else f"shard {s['shard']}: down (its experts from a live copy or the head's reads until Ray restarts it)"
        )
    copies = f"; {report['replicated']} held twice" if report.get("replicated") else ""
    lines.append(f"head: reads {len(report['head_reads'])} experts from disk{copies}; heat: {report['heat']}")
    return "\n".join(lines)


def _reachable(address: str | None) -> None:
    """A HOST:PORT address that nothing answers on is refused at once (Ray would retry it for minutes)."""
    import socket

    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "http")):
        return  # auto, local, a client address: Ray's own checks
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise WeightstreamError(
            f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the cluster with "
            "`ray start --head` on that machine, or leave --ray-address out to start a local one"
        ) from None


@contextlib.contextmanager
def ray_running(options: ShardOptions) -> Iterator[None]:
    """Ray for the block: a local cluster started here, or `options.address`'s joined, and shut down after; one
    already running in this process (a Ray Serve replica) is used as it is."""
    ray = _ray()
    _reachable(options.address)
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=options.address or "local", include_dashboard=False, log_to_driver=False)
        except Exception as exc:  # an address with no cluster, one that refuses us
            where = f"--ray-address {options.address}" if options.address else "a local Ray cluster"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WeightstreamError(f"{where}: Ray did not start or join it ({first})") from None
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def sharded(model, model_dir: str, options: ShardOptions, quiet: bool = False) -> Iterator[dict]:
    """`model`'s experts computed by `options.shards` Ray actors for the block (Ray running: `ray_running`), taken
    back after. Yields the plan (`plan_report`), printed on stderr unless `quiet` and saved to `options.plan_out` if
    given."""
    offered, home, heat_source = plan(model, options)
    runtime, report, cgroups = model.weightstream, {}, set()
    lock, remakes = threading.Lock(), []
    try:
        runtime.shards = start_shards(model_dir, offered, options, home)
        report = plan_report(runtime.shards, runtime.layout, heat_source, options)
        cgroups |= shard_cgroups(report)
        if options.plan_out:
            save_plan(report, options.plan_out)
        if not quiet:
            print(summary(report), file=sys.stderr)

        def remake(shards=runtime.shards):  # a shard went down or came back: the plan as it stands now
            now = plan_report(shards, runtime.layout, heat_source, options, strict=False)
            with lock:
                cgroups.update(shard_cgroups(now))  # a restarted shard's, to remove after
                report.update(now)  # the caller's copy (serve's /metrics) too
                if options.plan_out:
                    with contextlib.suppress(WeightstreamError):  # a full disk must not stop the answers
                        save_plan(now, options.plan_out)
                if not quiet:
                    print(f"weightstream: expert shards changed\n{summary(now)}", file=sys.stderr)

        def changed():  # off the decode path: asking a shard that died unseen waits for its timeout
            thread = threading.Thread(target=remake, name="weightstream-shard-plan", daemon=True)
            thread.start()
            remakes.append(thread)

        runtime.shards.on_change = changed
        yield report
    finally:
        if runtime.shards is not None:
            runtime.shards.close()
        runtime.shards = None
        for thread in remakes:
            thread.join(timeout=15)
        with lock:
            remove_cgroups(cgroups)


def save_plan(report: dict, path: str) -> None:
    """The plan as JSON at `path`, written beside it and renamed (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise WeightstreamError(f"--shard-plan {path}: cannot write it ({exc.strerror})") from None
