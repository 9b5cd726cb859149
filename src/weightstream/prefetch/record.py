"""`prefetch record`: run a command once and keep the order in which it missed the page cache on weight files."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from weightstream.errors import WeightstreamError
from weightstream.io.pagecache import evict_file
from weightstream.prefetch import tracefs
from weightstream.prefetch.events import MISS, READ, PageEvent, ReadSpans
from weightstream.prefetch.merge import RangeMerger
from weightstream.prefetch.pages import PageCounter
from weightstream.prefetch.procs import (
    WEIGHT_SUFFIXES,
    GatedCommand,
    mapped_weight_files,
    open_weight_files,
    process_tree,
)
from weightstream.prefetch.residency import ResidencySampler
from weightstream.prefetch.spec import DeploymentSpec
from weightstream.prefetch.store import save_template
from weightstream.prefetch.template import FileIdentity, LoadTemplate, WorkerTemplate
from weightstream.units import format_bytes


@dataclass(slots=True)
class RecordOptions:
    """What to record: the spec, the command, where the weights are (None: discover), keep the cache warm?"""

    spec: DeploymentSpec
    argv: list[str]
    model_dirs: list[Path] = field(default_factory=list)
    keep_cache: bool = False
    force_residency: bool = False  # use the sampling fallback even when tracefs works (tests, comparison)
    say: Callable[[str], None] = print


def weight_files(dirs: list[Path]) -> list[Path]:
    """Weight files (by suffix) directly in the given directories."""
    return sorted(p for d in dirs for p in d.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _ids(paths: list[Path]) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.realpath(p), st.st_dev, st.st_ino))
    return out


def reads_per_byte(counts: list[PageCounter]) -> float:
    """Bytes read / distinct bytes: ~1 for a loader that reads once, ~2 for one that makes two passes."""
    distinct = sum(c.distinct for c in counts)
    return round(sum(c.total for c in counts) / distinct, 2) if distinct else 1.0


class _Watcher:
    """Every 50 ms: which weight files the command's processes open or map, and how long each maps them.

    A process that maps its weight files until about its end (it outlives its last mapping by less than
    HOLD_S) keeps its tensors in the page cache (mmap loading: the mapping *is* the model), so what lies
    behind its read position must not be burnt after reading. One that unmaps them and then goes on (copied
    the weights, e.g. into a model's parameters) is safe to burn.
    """

    HOLD_S = 0.5

    def __init__(self, pid: int, on_new: Callable[[list[str]], None]) -> None:
        self.pid, self.on_new, self.seen = pid, on_new, set()
        self.mapped_until: dict[int, dict[str, float]] = {}  # pid -> weight file -> last sample finding it mapped
        self.alive_until: dict[int, float] = {}  # pid -> last sample that found the process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ws-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            pids, now = process_tree(self.pid), time.monotonic()
            for pid in pids:
                for path in mapped_weight_files(pid):
                    self.mapped_until.setdefault(pid, {})[path] = now
                if Path(f"/proc/{pid}/maps").exists():
                    self.alive_until[pid] = now
            new = open_weight_files(pids) - self.seen
            if new:
                self.seen |= new
                self.on_new(sorted(new))

    def held_files(self) -> dict[int, set[str]]:
        """pid -> the weight files it kept mapped to about its end (a loader that maps one shard at a time
        holds only the last; one whose mapping is the model holds them all)."""
        return {
            pid: {path for path, t in files.items() if self.alive_until.get(pid, t) - t < self.HOLD_S}
            for pid, files in self.mapped_until.items()
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Recorder:
    """Runs the command under an event source and merges its misses into a template."""

    def __init__(self, opts: RecordOptions) -> None:
        self.opts = opts
        self.merger = RangeMerger()
        self.reads: dict[int, dict[tuple[int, int], PageCounter]] = {}
        self.spans = ReadSpans()
        self.held: dict[int, set[str]] = {}
        self._span_pid: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self.known = [Path(p) for p in weight_files(opts.model_dirs)]
        root, self.why = (None, "forced residency sampling") if opts.force_residency else tracefs.find_tracefs()
        self.root = root
        self.source = "tracefs" if root else "residency"

    def on_events(self, events: list[PageEvent]) -> None:
        """Feed misses to the merger, per process; count reads to tell one-pass from multi-pass loaders."""
        for e in events:
            if e.kind == MISS:
                self.merger.add(e.tgid, self._name(e.tgid), (e.dev, e.ino), e.offset, e.length)
            elif e.kind == READ:
                self._span_pid[e.tid] = e.tgid
                for start, end in self.spans.feed(e):
                    self._count(e.tgid, (e.dev, e.ino), start, end - start)
            else:
                self._count(e.tgid, (e.dev, e.ino), e.offset, e.length)

    def _count(self, pid: int, key: tuple[int, int], offset: int, length: int) -> None:
        self.reads.setdefault(pid, {}).setdefault(key, PageCounter()).add(offset, length)

    def _name(self, pid: int) -> str:
        if pid not in self._names:
            try:
                self._names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                self._names[pid] = "process" if pid else "all processes"
        return self._names[pid]

    def run(self) -> tuple[int, set[str]]:
        """Run the command; returns its returncode and the weight files seen open."""
        if not self.opts.keep_cache:
            for p in self.known:
                evict_file(str(p))
        cmd = GatedCommand(self.opts.argv)
        source = watcher = None
        try:
            source = self._attach(cmd.pid)
            watcher = _Watcher(cmd.pid, self._discovered)
            rc = cmd.wait()
        except BaseException:
            cmd.kill()
            raise
        finally:
            for part in (watcher, source):
                if part is not None:
                    part.stop()
        self.events_lost = getattr(source, "lines_lost", 0)
        for tid, key, start, end in self.spans.flush():
            self._count(self._span_pid.get(tid, tid), key, start, end - start)
        self.held = watcher.held_files()
        return rc, watcher.seen

    def _attach(self, pid: int):
        if self.root is None:
            self.sampler = ResidencySampler(_ids(self.known))
            self.sampler.start(self.on_events)
            return self.sampler
        session = tracefs.TraceSession(self.root, buffer_kb=32768)
        try:
            session.follow_pid(pid)
            if self.known:
                session.set_filter(tracefs.inode_filter([(d, i) for _, d, i in _ids(self.known)]))
            session.start(self.on_events)
        except OSError as exc:
            session.stop()
            raise WeightstreamError(f"tracefs setup failed ({exc}); record with --sampling instead") from None
        return session

    def _discovered(self, paths: list[str]) -> None:
        if self.root is None:
            dirs = sorted({Path(p).parent for p in paths})
            self.sampler.add_files(_ids([p for p in weight_files(dirs) if p not in self.known]))

    def template(self, seen: set[str], seconds: float) -> LoadTemplate | None:
        """The template from the misses on weight files in the model directories; None if there were none."""
        dirs = self.opts.model_dirs or sorted({Path(p).parent for p in seen})
        by_id = {(d, i): path for path, d, i in _ids(weight_files(dirs))}
        files: list[str] = []
        workers = []
        for pid, worker in self.merger.workers():
            ranges = []
            for key, offset, length in worker.ranges:
                if key in by_id:
                    if by_id[key] not in files:
                        files.append(by_id[key])
                    ranges.append((files.index(by_id[key]), offset, length))
            if ranges:
                counts = [c for key, c in self.reads.get(pid, {}).items() if key in by_id]
                held = sorted({files.index(p) for p in self.held.get(pid, set()) if p in files})
                workers.append(WorkerTemplate(worker.name, ranges, reads_per_byte(counts), bool(held), held))
        if not workers:
            return None
        identities = [FileIdentity.of(p) for p in files]
        return LoadTemplate(self.opts.spec.as_dict(), self.opts.spec.key, identities, workers, self.source, seconds)


def record(opts: RecordOptions) -> int:
    """Record a template for opts.spec by running opts.argv; returns the command's returncode."""
    rec = Recorder(opts)
    opts.say(f"recording with {rec.source} events ({rec.why})")
    t0 = time.monotonic()
    rc, seen = rec.run()
    seconds = time.monotonic() - t0
    if rc != 0:
        opts.say(f"command exited with {rc}; template not saved (a failed load is not a template)")
        return rc
    template = rec.template(seen, seconds)
    if template is None:
        where = ", ".join(map(str, opts.model_dirs)) or "the files it opened"
        raise WeightstreamError(
            f"the command read no weight files from disk under {where}; pass --model-dir, "
            "and make sure the cache is cold (do not pass --keep-cache)"
        )
    _summarise(opts, rec, template, seconds)
    return rc


def _summarise(opts: RecordOptions, rec: Recorder, template: LoadTemplate, seconds: float) -> None:
    path = save_template(template, opts.spec)
    size = path.stat().st_size
    per_gib = size / max(template.bytes / (1 << 30), 1e-9)
    opts.say(
        f"recorded {len(template.files)} files, {template.ranges} ranges, {format_bytes(template.bytes)} in "
        f"{len(template.workers)} processes, {seconds:.2f} s"
    )
    opts.say(f"template {path} ({size} bytes, {per_gib:.0f} bytes per GiB read)")
    if getattr(rec, "events_lost", 0):
        opts.say(f"warning: {rec.events_lost} trace events were lost (buffer overrun); the template is partial")
    if rec.source == "residency":
        opts.say(
            f"note: residency sampling resolves order to ~{rec.sampler.resolution_s * 1000:.0f} ms and "
            "cannot tell processes apart"
        )
