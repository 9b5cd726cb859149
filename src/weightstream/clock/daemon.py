"""The clockfloor loop: detectors say which pids are decoding, the controller raises or restores the floor."""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass, field

from weightstream.clock.activity import AnnounceListener
from weightstream.clock.config import ClockConfig
from weightstream.clock.procscan import FlagMatcher, ProcessPoller
from weightstream.clock.state import StateFile
from weightstream.clock.uprobe import UprobeWatcher, unavailable_reason
from weightstream.errors import WeightstreamError

TICK_S = 0.1  # the longest the loop sleeps; announcements and uprobe lines wake it sooner


@dataclass(slots=True)
class FloorController:
    """Raise on the first activity, restore after hold_s without any; the state file brackets every raise."""

    backend: object
    state: StateFile
    hold_s: float
    log: object
    snapshot: dict | None = None
    last_active: float = 0.0
    seen: dict[int, str] = field(default_factory=dict)

    def repair(self) -> None:
        """Undo a floor left raised by a daemon that died."""
        stale = self.state.read()
        if stale is None:
            return
        if stale.get("unreadable") or stale.get("backend") != self.backend.kind:
            self.log(f"state file {self.state.path} is unreadable or from another backend; removed it")
        else:
            message = self.backend.restore(stale)
            self.log(f"repaired a floor left raised by pid {stale.get('pid', '?')}: {message}")
        self.state.clear()

    def update(self, active: dict[int, str], now: float) -> None:
        """Feed one tick's active pids."""
        self.seen.update(active)
        if active:
            self.last_active = now
            if self.snapshot is None:
                self._raise(active)
        elif self.snapshot is not None and now - self.last_active >= self.hold_s:
            self.lower("idle")

    def _raise(self, active: dict[int, str]) -> None:
        snapshot = self.backend.snapshot()
        self.state.write(snapshot)  # before touching the clock: a crash after the write below is repairable
        try:
            self.backend.apply(snapshot)
        except Exception:
            self.state.clear()  # nothing was raised, so there is nothing to restore
            raise
        self.snapshot = snapshot
        pid = min(active)
        self.log(f"floor {self.backend.raised_mhz(snapshot)} MHz (pid {pid} inference, {active[pid]})")

    def lower(self, reason: str) -> None:
        """Put the original floor back now, if raised."""
        if self.snapshot is None:
            return
        snapshot, self.snapshot = self.snapshot, None
        message = self.backend.restore(snapshot)
        self.state.clear()
        if "left as is" in message:
            self.log(f"floor not restored ({reason}): {message}")
        else:
            self.log(f"floor {self.backend.idle_mhz(snapshot)} MHz ({reason})")


class _PollDetector:
    """ProcessPoller has nothing to select on."""

    name = "poll"

    def __init__(self, poller: ProcessPoller):
        self.poller = poller

    def fileno(self) -> None:
        """Nothing to wait on: the loop's tick drives polling."""
        return None

    def collect(self, now: float) -> dict[int, str]:
        """Busy flagged pids as of the latest poll."""
        return self.poller.collect(now)

    def close(self) -> None:
        """Nothing to release."""


class Daemon:
    """Owns the detectors, the controller and the stop pipe."""

    def __init__(self, config: ClockConfig, backend, log, clock=time.monotonic):
        self.config, self.backend, self.log, self.clock = config, backend, log, clock
        self.state = StateFile(config.state_file)
        self.controller = FloorController(backend, self.state, config.hold_s, log)
        self.detectors: list = []
        self.stopping: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def stop(self, reason: str) -> None:
        """Ask the loop to restore and return; safe from a signal handler or another thread."""
        self.stopping = reason
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def run(self, duration_s: float | None = None) -> dict[int, str]:
        """Repair, detect until stopped (or for duration_s), restore; returns every pid seen active."""
        self.backend.require_writable()
        self.state.acquire()
        try:
            self.controller.repair()
            self.detectors = self._open_detectors()
            self._banner()
            self._loop(None if duration_s is None else self.clock() + duration_s)
        finally:
            try:
                self.controller.lower(self.stopping or ("window over" if duration_s else "stopping"))
            finally:
                for detector in self.detectors:
                    detector.close()
                self.state.release()
        return dict(self.controller.seen)

    def _banner(self) -> None:
        snapshot, methods = self.backend.snapshot(), " ".join(detector.name for detector in self.detectors)
        self.log(
            f"clockfloor: {self.backend.label()}: floor {self.backend.raised_mhz(snapshot)} MHz during "
            f"inference, {self.backend.idle_mhz(snapshot)} MHz otherwise; hold {self.config.hold_s:g} s; "
            f"detecting by {methods}; settings from {self.config.source}"
        )

    def _open_detectors(self) -> list:
        config, matcher, detectors = self.config, FlagMatcher(self.config.flags), []
        if "uprobe" in config.detect:
            reason = unavailable_reason()
            if reason:
                self.log(f"uprobes: off, {reason}")
            else:
                detectors.append(UprobeWatcher(matcher, config.libraries, config.rescan_s, self.log))
        if "announce" in config.detect:
            try:
                detectors.append(AnnounceListener(config.socket))
            except OSError as exc:
                self.log(f"announce: off, cannot listen on {config.socket} ({exc.strerror})")
        if "poll" in config.detect:
            detectors.append(_PollDetector(ProcessPoller(matcher, config.cpu_threshold, config.poll_s)))
        if not detectors:
            detect = " ".join(config.detect)
            raise WeightstreamError(f"no activity detector could start (DETECT={detect}); see the lines above")
        return detectors

    def _loop(self, deadline: float | None) -> None:
        while self.stopping is None:
            now = self.clock()
            if deadline is not None and now >= deadline:
                return
            descriptors = [self._wake_r] + [fd for d in self.detectors if (fd := d.fileno()) is not None]
            select.select(descriptors, [], [], TICK_S)
            try:
                os.read(self._wake_r, 64)
            except BlockingIOError:
                pass
            now, active = self.clock(), {}
            for detector in self.detectors:
                active.update(detector.collect(now))
            if self.stopping is None:
                self.controller.update(active, now)
