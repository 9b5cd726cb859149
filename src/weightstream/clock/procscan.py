"""Polling fallback: processes whose argv carries a configured flag and which are using CPU.

CPU-expert inference burns CPU on every token; the same server waiting for requests does not. So a matching
process counts as inference while its CPU time grows by at least `cpu_threshold` cores between two polls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# A pid is re-read while young (fork happens before exec, so its first argv may be its parent's), then rarely.
YOUNG_S = 1.0
RECHECK_S = 5.0


def read_argv(pid: int, proc_root: str = "/proc") -> list[str] | None:
    """A process's argv, None once it is gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_cpu_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """utime + stime in clock ticks, None once the process is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses; the fields after the last ')' are fixed.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def is_running(pid: int, proc_root: str = "/proc") -> bool:
    """Alive and not a zombie (a killed process stays in /proc until its parent reaps it)."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3] not in (b"Z", b"X")


@dataclass(slots=True)
class FlagMatcher:
    """Which configured flag, if any, a command line carries (`--n-cpu-moe 8` and `--n-cpu-moe=8` both count)."""

    flags: tuple[str, ...]

    def match(self, argv: list[str]) -> str | None:
        """The first configured flag found in argv[1:], else None."""
        for word in argv[1:]:
            for flag in self.flags:
                if word == flag or word.startswith(flag + "="):
                    return flag
        return None


@dataclass(slots=True)
class _Seen:
    flag: str | None
    first_seen: float
    checked_at: float
    ticks: int | None = None
    ticks_at: float = 0.0


class ProcessPoller:
    """Every `poll_s`, the matching processes whose CPU use reached `cpu_threshold` cores."""

    def __init__(
        self,
        matcher: FlagMatcher,
        cpu_threshold: float,
        poll_s: float,
        proc_root: str = "/proc",
        exclude: frozenset[int] = frozenset(),
    ):
        self.matcher = matcher
        self.cpu_threshold = cpu_threshold
        self.poll_s = poll_s
        self.proc_root = proc_root
        self.exclude = exclude | {os.getpid()}
        self.ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.seen: dict[int, _Seen] = {}
        self.active: dict[int, str] = {}
        self.cores: dict[int, float] = {}
        self._next_poll = 0.0

    def collect(self, now: float) -> dict[int, str]:
        """{pid: 'poll <flag>'} for busy matching processes; between polls, the last answer."""
        if now >= self._next_poll:
            self._next_poll = now + self.poll_s
            self.active = self._poll(now)
        return self.active

    def _poll(self, now: float) -> dict[int, str]:
        pids = {int(name) for name in os.listdir(self.proc_root) if name.isdigit()} - self.exclude
        for gone in self.seen.keys() - pids:
            del self.seen[gone]
        active: dict[int, str] = {}
        self.cores = {}
        for pid in pids:
            seen = self._classify(pid, now)
            if seen.flag is None:
                continue
            cores = self._cpu_cores(pid, seen, now)
            if cores is not None:
                self.cores[pid] = cores
                if cores >= self.cpu_threshold:
                    active[pid] = f"poll {seen.flag}"
        return active

    def _classify(self, pid: int, now: float) -> _Seen:
        seen = self.seen.get(pid)
        if seen is None:
            seen = self.seen[pid] = _Seen(flag=None, first_seen=now, checked_at=-1e18)
        recheck = 0.0 if now - seen.first_seen < YOUNG_S else RECHECK_S
        if now - seen.checked_at >= recheck:
            argv = read_argv(pid, self.proc_root) or []
            flag = self.matcher.match(argv)
            if flag != seen.flag:
                seen.ticks = None  # a new program after exec: start its CPU baseline afresh
            seen.flag, seen.checked_at = flag, now
        return seen

    def _cpu_cores(self, pid: int, seen: _Seen, now: float) -> float | None:
        ticks = read_cpu_ticks(pid, self.proc_root)
        previous, previous_at = seen.ticks, seen.ticks_at
        seen.ticks, seen.ticks_at = ticks, now
        if ticks is None or previous is None or now <= previous_at:
            return None
        return (ticks - previous) / self.ticks_per_s / (now - previous_at)
