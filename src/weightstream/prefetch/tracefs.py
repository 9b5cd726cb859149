"""The kernel's own page-cache events, from a private tracefs instance (root only).

We never touch the global trace buffer: each session makes instances/weightstream-<pid>-<n>, limits events to
the command's process tree (set_event_pid + event-fork, so descendants are followed in the kernel) and to
the model files' inodes, and removes the instance when done. Instances left by a killed weightstream are
removed by the next session.
"""

from __future__ import annotations

import itertools
import os
import select
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from weightstream.prefetch import rawtrace
from weightstream.prefetch.events import EVENT_KINDS, TRACE_EVENTS, PageEvent, kernel_dev, parse_trace_text

CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
REQUIRED = "filemap/mm_filemap_add_to_page_cache"
_PREFIX = "weightstream-"
_counter = itertools.count()


def find_tracefs(mount: bool = True) -> tuple[Path | None, str]:
    """The tracefs root with the filemap events, or None and the reason; as root, mounts it if needed."""
    if os.geteuid() != 0:
        return None, "not root: tracefs page-cache events need root"
    for root in CANDIDATES:
        if (root / "events" / REQUIRED).exists():
            return root, f"tracefs at {root}"
    if mount and CANDIDATES[0].is_dir() and not any(CANDIDATES[0].iterdir()):
        done = subprocess.run(["mount", "-t", "tracefs", "nodev", str(CANDIDATES[0])], capture_output=True)
        if done.returncode == 0 and (CANDIDATES[0] / "events" / REQUIRED).exists():
            return CANDIDATES[0], f"tracefs mounted at {CANDIDATES[0]}"
    return None, f"tracefs with {REQUIRED} not found under {', '.join(map(str, CANDIDATES))}"


def remove_stale_instances(root: Path) -> list[str]:
    """Remove instances left by weightstream processes that no longer exist; returns their names."""
    removed = []
    for inst in (root / "instances").glob(f"{_PREFIX}*"):
        pid = inst.name[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove(inst)
            removed.append(inst.name)
    return removed


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _remove(inst: Path) -> None:
    try:
        _write(inst / "tracing_on", "0")
        for event in TRACE_EVENTS:
            _write(inst / "events" / "filemap" / event / "enable", "0")
        inst.rmdir()
    except OSError:
        pass  # already gone, or busy: the next session retries


def inode_filter(files: list[tuple[int, int]], exclude_tids: list[int] = ()) -> str:
    """A tracefs filter for (st_dev, inode) pairs, optionally excluding our own threads."""
    by_dev: dict[int, list[int]] = {}
    for dev, ino in files:
        by_dev.setdefault(kernel_dev(dev), []).append(ino)
    parts = [
        f"(s_dev == {d} && ({' || '.join(f'i_ino == {i}' for i in sorted(set(inos)))}))"
        for d, inos in sorted(by_dev.items())
    ]
    text = " || ".join(parts) or "i_ino == 0"
    if exclude_tids:
        text = f"({text}) && " + " && ".join(f"common_pid != {t}" for t in exclude_tids)
    return text


class TraceSession:
    """One private tracefs instance delivering parsed PageEvents to a callback from a reader thread."""

    def __init__(self, root: Path, buffer_kb: int = 16384, events: tuple[str, ...] = TRACE_EVENTS) -> None:
        self.root, self.events = root, events
        remove_stale_instances(root)
        self.inst = root / "instances" / f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.inst.mkdir()
        _write(self.inst / "buffer_size_kb", str(buffer_kb))
        _write(self.inst / "options" / "record-tgid", "1")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.lines_lost = 0
        self.pages_lost = 0  # binary pages marked as following lost events
        self.format = "text" if os.environ.get("WEIGHTSTREAM_TRACE_TEXT") == "1" else "binary"
        self._formats = None
        if self.format == "binary":
            try:  # the events' binary layout; where it cannot be read, the text pipe still works
                kinds = {name: EVENT_KINDS[name] for name in events}
                self._formats = rawtrace.read_formats(root / "events" / "filemap", kinds)
            except (OSError, ValueError, KeyError):
                self.format = "text"

    def follow_pid(self, pid: int) -> None:
        """Trace pid and (event-fork) every task it creates from now on."""
        _write(self.inst / "options" / "event-fork", "1")
        fd = os.open(self.inst / "set_event_pid", os.O_WRONLY)  # no O_TRUNC: adds to the list
        try:
            os.write(fd, f"{pid}\n".encode())
        finally:
            os.close(fd)

    def set_filter(self, text: str) -> None:
        """Apply one filter expression to every traced event."""
        for event in self.events:
            _write(self.inst / "events" / "filemap" / event / "filter", text)

    def start(self, on_events: Callable[[list[PageEvent]], None]) -> None:
        """Enable the events and start reading trace_pipe in a thread."""
        for event in self.events:
            _write(self.inst / "events" / "filemap" / event / "enable", "1")
        _write(self.inst / "tracing_on", "1")
        target = self._read_binary if self.format == "binary" else self._read
        self._thread = threading.Thread(target=target, args=(on_events,), name="ws-trace", daemon=True)
        self._thread.start()

    def _read(self, on_events: Callable[[list[PageEvent]], None]) -> None:
        fd = os.open(self.inst / "trace_pipe", os.O_RDONLY | os.O_NONBLOCK)
        poller, tail = select.poll(), b""
        poller.register(fd, select.POLLIN)
        try:
            while True:
                stopping = self._stop.is_set()
                chunk = _drain(fd) if stopping or poller.poll(50) else b""
                if chunk:
                    data, _, tail = (tail + chunk).rpartition(b"\n")
                    on_events(parse_trace_text(data))
                elif stopping:
                    return
        finally:
            os.close(fd)

    def _read_binary(self, on_events: Callable[[list[PageEvent]], None]) -> None:
        """Per-CPU ring-buffer pages, merged in time order each round (see rawtrace)."""
        cpus = sorted(self.inst.glob("per_cpu/cpu*/trace_pipe_raw"))
        fds = [os.open(p, os.O_RDONLY | os.O_NONBLOCK) for p in cpus]
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        tgid_of = rawtrace.TgidMap(self.root / "saved_tgids")
        page_size = os.sysconf("SC_PAGE_SIZE")
        try:
            while True:
                stopping = self._stop.is_set()
                if not stopping:
                    poller.poll(50)
                records = []
                for fd in fds:
                    for page in _reads(fd, page_size):
                        got, lost = rawtrace.parse_page(page, self._formats)
                        records += got
                        self.pages_lost += lost
                if records:
                    records.sort(key=lambda r: r[0])  # stable: one CPU's events keep their order
                    on_events(rawtrace.to_page_events(records, tgid_of))
                elif stopping:
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self) -> None:
        """Stop tracing, deliver what is left in the buffer, join the reader and remove the instance."""
        try:
            _write(self.inst / "tracing_on", "0")
        finally:
            self._stop.set()
            if self._thread:
                self._thread.join()
            self.lines_lost = self._overruns()
            _remove(self.inst)

    def _overruns(self) -> int:
        lost = 0
        for stats in (self.inst / "per_cpu").glob("cpu*/stats"):
            for line in stats.read_text().splitlines():
                if line.startswith("overrun:"):
                    lost += int(line.split()[1])
        return lost


def _reads(fd: int, size: int) -> list[bytes]:
    """Every read of up to `size` bytes a non-blocking fd gives until it has nothing more (on a per-CPU
    trace_pipe_raw, one read is one page, a partly filled one too)."""
    parts = []
    while True:
        try:
            part = os.read(fd, size)
        except BlockingIOError:
            break
        if not part:
            break
        parts.append(part)
    return parts


def _drain(fd: int) -> bytes:
    return b"".join(_reads(fd, 1 << 20))
