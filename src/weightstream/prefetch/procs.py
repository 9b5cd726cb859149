"""The wrapped command: started held at a gate, released, waited for, its exit status passed through.

The command inherits stdin, stdout and stderr untouched. The wrapper ignores SIGINT and SIGQUIT while waiting
(the terminal delivers them to the whole foreground group, so the command gets them itself, as with GNU
time) and forwards SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2. The command is started with PR_SET_PDEATHSIG so that
it cannot outlive a wrapper killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from pathlib import Path

from weightstream.errors import WeightstreamError

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
IGNORED = (signal.SIGINT, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1


class GatedCommand:
    """A child process that exists (so its pid can be traced) but runs the command only when released.

    Plain fork + exec rather than subprocess: subprocess waits for the exec before returning, which a child
    held at a gate never reaches.
    """

    def __init__(self, argv: list[str]) -> None:
        if not argv:
            raise WeightstreamError("no command given; put it after --, e.g. -- python load.py")
        if shutil.which(argv[0]) is None:
            raise WeightstreamError(f"cannot run {argv[0]!r}: not found or not executable; check the command after --")
        gate_r, self._gate_w = os.pipe()
        self._err_r, err_w = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            _child(argv, parent, gate_r, self._gate_w, err_w)
        os.close(gate_r)
        os.close(err_w)
        self.returncode: int | None = None
        self._saved: dict[int, object] = {}
        self._install()  # from now on a signal meant for the command reaches it, even during our setup

    def release(self) -> None:
        """Let the command run; raises WeightstreamError if it could not be executed."""
        if self._gate_w < 0:
            return
        os.write(self._gate_w, b"x")
        os.close(self._gate_w)
        self._gate_w = -1
        err = os.read(self._err_r, 64)  # empty once exec closed the pipe (close-on-exec)
        os.close(self._err_r)
        if err:
            self._reap()
            self._restore()
            raise WeightstreamError(f"cannot run the command after --: {os.strerror(int(err))}")

    def wait(self) -> int:
        """Wait for the command with signals arranged as documented above; returns its returncode."""
        self.release()
        try:
            return self._reap()
        finally:
            self._restore()

    def _reap(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _install(self) -> None:
        for sig in FORWARDED:
            self._saved[sig] = signal.signal(sig, self._forward)
        for sig in IGNORED:
            self._saved[sig] = signal.signal(sig, signal.SIG_IGN)

    def _forward(self, signum: int, _frame) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def _restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def kill(self) -> None:
        """Kill and reap the command (used when the wrapper itself fails before the command finished)."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
        if self._gate_w >= 0:
            os.close(self._gate_w)
            os.close(self._err_r)
            self._gate_w = -1
        self._reap()
        self._restore()


def _child(argv: list[str], parent: int, gate_r: int, gate_w: int, err_w: int) -> None:
    """In the forked child: die with the wrapper, wait at the gate, exec; never returns."""
    try:
        os.close(gate_w)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the wrapper died before prctl took effect
            os._exit(137)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the command must not inherit that
            signal.signal(sig, signal.SIG_DFL)
        if os.read(gate_r, 1):
            os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(err_w, str(exc.errno or 1).encode())
    finally:
        os._exit(127)


def exit_like(returncode: int) -> int:
    """Leave the way the command left: same exit code, or die by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if returncode < 0:
        sig = -returncode
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, hence need no reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # only reached for signals whose default action is not to terminate
    return returncode


def process_tree(root: int) -> list[int]:
    """root and its descendants (pids), from /proc/<pid>/task/*/children."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
    return out


def open_weight_files(pids: list[int]) -> set[str]:
    """Weight files (by suffix) the processes have open or mapped right now."""
    found: set[str] = set()
    for pid in pids:
        found |= _fd_targets(pid) | _mapped(pid)
    return {p for p in found if p.endswith(WEIGHT_SUFFIXES)}


def _fd_targets(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                out.add(os.readlink(fd.path))
            except OSError:
                pass
    except OSError:
        pass
    return out


def mapped_weight_files(pid: int) -> set[str]:
    """Weight files the process has mapped right now."""
    return {p for p in _mapped(pid) if p.endswith(WEIGHT_SUFFIXES)}


def _mapped(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return set()
