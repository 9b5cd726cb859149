"""uprobes on llama.cpp: bpftrace reports entry and return of its decode functions, per process.

Libraries are found in the memory maps of processes whose argv carries a configured flag (only those count,
so only those are worth probing) plus any configured paths. Every `rescan_s` the set is read again; when a
library was rebuilt (new inode or mtime) bpftrace is restarted on the new files. Needs root and bpftrace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from weightstream.clock.procscan import FlagMatcher, is_running, read_argv

PROBED_FUNCTIONS = ("llama_decode", "llama_process", "llama_synchronize")
LIBRARY_NAME = re.compile(r"^libllama\.so(\.\d+)*$")
SAFE_PATH = re.compile(r"^[\w./+-]+$")  # bpftrace probe specs cannot carry spaces, quotes or colons
NOISE = ("RLIMIT_MEMLOCK",)  # bpftrace warns about it even where BPF memory is accounted by cgroup


@dataclass(frozen=True, slots=True)
class Library:
    """A library file as the kernel identifies it; a rebuild gives a new inode or mtime."""

    path: str
    inode: int
    mtime_ns: int


def unavailable_reason(bpftrace: str = "bpftrace") -> str | None:
    """Why uprobes cannot be used here, or None when they can be tried."""
    if shutil.which(bpftrace) is None:
        return f"{bpftrace} not found on PATH (install it: apt-get install bpftrace)"
    if os.geteuid() != 0 or not _can_attach_probes():
        return "uprobes need root with CAP_SYS_ADMIN (or CAP_BPF and CAP_PERFMON); run the daemon as root"
    return None


def _can_attach_probes() -> bool:
    """Whether this process's effective capabilities allow loading BPF programs onto uprobes."""
    try:
        with open("/proc/self/status") as handle:
            effective = next(int(line.split()[1], 16) for line in handle if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    sys_admin, perfmon, bpf = 1 << 21, 1 << 38, 1 << 39
    return bool(effective & sys_admin) or (effective & (perfmon | bpf)) == perfmon | bpf


def library_at(path: str) -> Library | None:
    """Stat a library path; None when it is missing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return Library(path=path, inode=info.st_ino, mtime_ns=info.st_mtime_ns)


def mapped_libraries(pid: int, proc_root: str = "/proc") -> set[Library]:
    """libllama.so files mapped by one process, by a path this process can open."""
    found: set[Library] = set()
    try:
        with open(f"{proc_root}/{pid}/maps") as handle:
            lines = [line for line in handle if "libllama" in line]
    except OSError:
        return found
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if path.endswith("(deleted)") or not LIBRARY_NAME.match(os.path.basename(path)):
            continue
        inode = int(parts[4])
        # Another mount namespace (a container) maps a path we may not see; its root is reachable through /proc.
        for candidate in (path, f"{proc_root}/{pid}/root{path}"):
            library = library_at(candidate)
            if library and library.inode == inode:
                found.add(library)
                break
    return found


def probe_symbols(library: Library, bpftrace: str = "bpftrace") -> list[str]:
    """Which of the probed functions the library exports (bpftrace refuses to attach to missing ones)."""
    try:
        result = subprocess.run(
            [bpftrace, "-l", f"uprobe:{library.path}:llama_*"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = {line.rsplit(":", 1)[-1].strip() for line in result.stdout.splitlines()}
    return [name for name in PROBED_FUNCTIONS if name in names]


def bpftrace_script(probes: dict[str, list[str]]) -> str:
    """Print 'E pid' when a process enters its outermost probed call and 'R pid' when it leaves it."""
    entries = ", ".join(f"uprobe:{path}:{name}" for path, names in probes.items() for name in names)
    returns = entries.replace("uprobe:", "uretprobe:")
    return (
        'BEGIN { printf("READY\\n"); }\n'
        f'{entries} {{ @depth[pid] = @depth[pid] + 1; if (@depth[pid] == 1) {{ printf("E %d\\n", pid); }} }}\n'
        f"{returns} {{ if (@depth[pid] > 0) {{ @depth[pid] = @depth[pid] - 1; }}"
        ' if (@depth[pid] == 0) { printf("R %d\\n", pid); } }\n'
        "END { clear(@depth); }\n"
    )


class UprobeWatcher:
    """Runs bpftrace on the current libraries and turns its lines into active pids."""

    name = "uprobe"

    def __init__(
        self,
        matcher: FlagMatcher,
        libraries: tuple[str, ...],
        rescan_s: float,
        log,
        proc_root: str = "/proc",
        bpftrace: str = "bpftrace",
    ):
        self.matcher, self.libraries, self.rescan_s = matcher, libraries, rescan_s
        self.log, self.proc_root, self.bpftrace = log, proc_root, bpftrace
        self.process: subprocess.Popen | None = None
        self.attached: frozenset[Library] = frozenset()
        self.ready = False
        self.inside: set[int] = set()
        self.touched: set[int] = set()
        self.flag_of: dict[int, str | None] = {}
        self._partial = b""
        self._next_rescan = 0.0

    def fileno(self) -> int | None:
        """bpftrace's stdout, for select(); None while not running."""
        return self.process.stdout.fileno() if self.process else None

    def maybe_rescan(self, now: float) -> None:
        """Every rescan_s, re-read the libraries and restart bpftrace if they changed."""
        if now < self._next_rescan:
            return
        self._next_rescan = now + self.rescan_s
        self.flag_of = {pid: flag for pid, flag in self.flag_of.items() if os.path.exists(f"{self.proc_root}/{pid}")}
        libraries = frozenset(self.discover())
        if libraries != self.attached:
            self._restart(libraries)

    def discover(self) -> set[Library]:
        """Configured libraries plus those mapped by flag-carrying processes."""
        found = {library for library in map(library_at, self.libraries) if library}
        for name in os.listdir(self.proc_root):
            if name.isdigit() and self.matcher.match(read_argv(int(name), self.proc_root) or []):
                found |= mapped_libraries(int(name), self.proc_root)
        return {library for library in found if SAFE_PATH.match(library.path)}

    def _restart(self, libraries: frozenset[Library]) -> None:
        self.stop()
        self.attached = libraries
        probes = {library.path: probe_symbols(library, self.bpftrace) for library in sorted(libraries, key=str)}
        probes = {path: names for path, names in probes.items() if names}
        if not probes:
            return
        command = [self.bpftrace, "-B", "none", "-q", "-e", bpftrace_script(probes)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.set_blocking(self.process.stdout.fileno(), False)
        os.set_blocking(self.process.stderr.fileno(), False)
        described = "; ".join(f"{path} ({', '.join(names)})" for path, names in probes.items())
        self.log(f"uprobes: attaching to {described}")

    def collect(self, now: float) -> dict[int, str]:
        """{pid: 'uprobe <flag>'} for matching processes inside a probed call or seen since the last collect."""
        self.maybe_rescan(now)
        if self.process is not None:
            self._log_errors(_drain(self.process.stderr))
            self._read_events()
        self.inside = {pid for pid in self.inside if is_running(pid, self.proc_root)}
        pids, self.touched = self.inside | self.touched, set()
        return {pid: f"uprobe {flag}" for pid in pids if (flag := self._flag(pid))}

    def _flag(self, pid: int) -> str | None:
        if pid not in self.flag_of:
            self.flag_of[pid] = self.matcher.match(read_argv(pid, self.proc_root) or [])
        return self.flag_of[pid]

    def _read_events(self) -> None:
        chunks = []
        while True:
            try:
                chunk = os.read(self.process.stdout.fileno(), 65536)
            except BlockingIOError:
                break
            if not chunk:
                self._report_exit()
                break
            chunks.append(chunk)
        lines = (self._partial + b"".join(chunks)).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._event(line.decode(errors="replace").split())

    def _event(self, words: list[str]) -> None:
        if words == ["READY"]:
            self.ready = True
            self.log(f"uprobes: attached (bpftrace pid {self.process.pid})")
        elif len(words) == 2 and words[0] in ("E", "R") and words[1].isdigit():
            pid = int(words[1])
            self.touched.add(pid)
            (self.inside.add if words[0] == "E" else self.inside.discard)(pid)

    def _log_errors(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip() and not any(noise in line for noise in NOISE):
                self.log(f"uprobes: bpftrace: {line.strip()}")

    def _report_exit(self) -> None:
        process, self.process = self.process, None
        self._log_errors(_drain(process.stderr))
        self.log(f"uprobes: bpftrace exited with status {process.wait()}; retrying when the libraries change")
        process.stdout.close()
        process.stderr.close()
        self.ready = False

    def close(self) -> None:
        """Stop watching."""
        self.stop()

    def stop(self) -> None:
        """Stop bpftrace (its probes detach with it)."""
        process, self.process = self.process, None
        self.ready, self._partial = False, b""
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def _drain(stream) -> str:
    try:
        return (stream.read() or b"").decode(errors="replace")
    except (BlockingIOError, ValueError):
        return ""
