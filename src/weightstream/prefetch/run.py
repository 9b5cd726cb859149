"""`prefetch run`: start the command at once and, with a valid template, prefetch ahead of its loader."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from weightstream.cgroup import CgroupMemory
from weightstream.prefetch import tracefs
from weightstream.prefetch.plan import Plan
from weightstream.prefetch.prefetcher import Prefetcher
from weightstream.prefetch.procs import GatedCommand
from weightstream.prefetch.report import RunReport
from weightstream.prefetch.residency import ResidencySampler
from weightstream.prefetch.settings import Settings
from weightstream.prefetch.spec import DeploymentSpec
from weightstream.prefetch.store import Lookup, find_template
from weightstream.units import format_bytes

AUTO_BUDGET_SHARE = 4  # in a memory-limited cgroup without --memory-budget: a quarter of the room left


@dataclass(slots=True)
class RunOptions:
    """The spec, the command, prefetch settings, and how to speak (stderr lines)."""

    spec: DeploymentSpec
    argv: list[str]
    settings: Settings
    force_residency: bool = False
    say: Callable[[str], None] = print


class _Session:
    """Everything attached to one command run; stop() undoes it in order, whatever state it got to."""

    def __init__(self, opts: RunOptions, lookup: Lookup) -> None:
        self.opts, self.lookup = opts, lookup
        self.trace: tracefs.TraceSession | None = None
        self.sampler: ResidencySampler | None = None
        self.prefetcher: Prefetcher | None = None
        self.source: str | None = None
        self.reason = lookup.reason
        root, why = (None, "forced") if opts.force_residency else tracefs.find_tracefs()
        if lookup.template is not None and root is not None:
            self.trace = tracefs.TraceSession(root)
            self.source = "tracefs"
        elif lookup.template is not None:
            self.source = "residency"
            opts.say(f"no tracefs ({why}): following the loader by residency sampling")

    def attach(self, pid: int) -> None:
        """Before the command runs: follow its process tree and the template's files."""
        if self.trace:
            ids = [(f.dev, f.inode) for f in self.lookup.template.files]
            self.trace.follow_pid(pid)
            self.trace.set_filter(tracefs.inode_filter(ids))

    def begin(self) -> None:
        """After the command started: verify the files, then start events and prefetch threads."""
        template = self.lookup.template
        if template is None:
            return
        for identity in template.files:
            reason = identity.mismatch()
            if reason:
                self._drop(reason)
                return
        self._apply_auto_budget()
        paths = [f.path for f in template.files]
        ids = [(f.dev, f.inode) for f in template.files]
        self.prefetcher = Prefetcher(Plan.from_template(template), paths, ids, self.opts.settings)
        if self.trace:
            self.trace.start(self.prefetcher.on_events)
        else:
            self.prefetcher.own_misses_visible = True
            self.sampler = ResidencySampler([(p, d, i) for p, (d, i) in zip(paths, ids)])
            self.sampler.start(self.prefetcher.on_events)
        self.prefetcher.go()

    def _drop(self, reason: str) -> None:
        self.reason, self.source = reason, None
        self.lookup = Lookup(None, reason, self.lookup.path)
        self.opts.say(f"template ignored: {reason}")
        self._stop_events()

    def _apply_auto_budget(self) -> None:
        s = self.opts.settings
        s.cgroup = CgroupMemory.of()
        if s.budget is None and s.cgroup is not None and s.cgroup.limited:
            s.budget = max(64 << 20, (s.cgroup.limit - s.cgroup.usage) // AUTO_BUDGET_SHARE)
            self.opts.say(
                f"memory cgroup limit {format_bytes(s.cgroup.limit)}: prefetch budget {format_bytes(s.budget)} "
                "(pass --memory-budget to choose)"
            )

    def _stop_events(self) -> None:
        for part in (self.trace, self.sampler):
            if part is not None:
                part.stop()
        self.trace = self.sampler = None

    def fail(self, exc: BaseException) -> None:
        """Our own failure after the command started: stop prefetching, say why in one line, carry on."""
        self._drop(f"prefetch disabled ({type(exc).__name__}: {exc})")
        if self.prefetcher is not None:
            self.prefetcher.stop()
            self.prefetcher = None

    def stop(self) -> int:
        """Stop events (delivering the last ones), then the threads; returns trace events lost."""
        trace = self.trace
        try:
            self._stop_events()
        finally:
            if self.prefetcher is not None:
                self.prefetcher.stop()
        return trace.lines_lost if trace else 0


def run(opts: RunOptions) -> tuple[int, RunReport]:
    """Run the command with prefetch where a valid template exists; returns its returncode and the report."""
    lookup = find_template(opts.spec, check_files=False)  # fingerprints are checked once the command runs
    if lookup.template is None:
        opts.say(f"template ignored: {lookup.reason}")
    session = _Session(opts, lookup)
    try:
        cmd = GatedCommand(opts.argv)
    except BaseException:
        session.stop()
        raise
    try:
        rc, seconds = _supervise(cmd, session)
    finally:
        lost = _stop_quietly(session)
    return rc, _report(opts, session, rc, seconds, lost)


def _supervise(cmd: GatedCommand, session: _Session) -> tuple[int, float]:
    """Attach, release, begin, wait. Our failures disable prefetch; they never stop or alter the command."""
    try:
        session.attach(cmd.pid)
    except Exception as exc:
        session.fail(exc)
    cmd.release()
    t0 = time.monotonic()
    try:
        session.begin()
    except Exception as exc:
        session.fail(exc)
    try:
        rc = cmd.wait()
    except BaseException:
        cmd.kill()
        raise
    return rc, time.monotonic() - t0


def _stop_quietly(session: _Session) -> int:
    try:
        return session.stop()
    except OSError as exc:  # e.g. the trace instance vanished: the command's outcome must not change
        os.write(2, f"weightstream prefetch: cleanup: {exc}\n".encode())
        return 0


def _report(opts: RunOptions, session: _Session, rc: int, seconds: float, lost: int) -> RunReport:
    s, p = opts.settings, session.prefetcher
    report = RunReport(
        opts.spec.as_dict(),
        p is not None,
        session.reason,
        session.source,
        rc,
        seconds,
        threads=s.threads,
        numa=s.placement.message,
        events_lost=lost,
    )
    if p is None:
        return report
    c = p.counters
    report.bytes_template, report.bytes_prefetched = p.plan.bytes, c.prefetched
    report.bytes_already_cached, report.bytes_abandoned = c.already_cached, c.abandoned
    report.bytes_used = p.used_bytes() if session.source == "tracefs" else None
    report.bytes_reclaimed, report.bytes_reread_after_reclaim = c.reclaimed, c.reread_after_reclaim
    report.bytes_loader_missed, report.pressure_pauses = c.loader_missed, c.pressure_pauses
    report.memory_budget, report.peak_ahead, report.rewinds = s.budget, c.peak_ahead, c.rewinds
    report.bytes_evicted_before_use, report.final_budget = c.evicted_before_use, p.budget
    report.reclaim_gap = s.reclaim_gap if s.budget is not None else None
    report.failed_chunks, report.events = c.failed_chunks, c.events
    step = max(1, len(c.timeline) // 200)  # the JSON report keeps about 200 points of the cursor's path
    report.timeline = c.timeline[::step]
    return report
