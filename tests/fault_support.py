"""What tests/test_fault_injection.py needs to kill `weightstream` processes where it chooses and to fill a disk:
the number of kill points (WEIGHTSTREAM_FAULT_KILLS), a command run until a trigger fires and then SIGKILLed,
the Python audit hook that SIGKILLs a process at the one instant no poll from outside can catch (a rename), and
a small tmpfs mounted for the disk-full cases."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

KILLS_VARIABLE = "WEIGHTSTREAM_FAULT_KILLS"
CLI = [sys.executable, "-m", "weightstream.cli"]
RUN_LIMIT_S = 300  # one run of a tiny model takes seconds; past this it hangs
POLL_S = 0.002

# The variable naming the path whose rename kills the process, read by the hook below. Python raises the audit
# event "os.rename" (os.rename and os.replace) before the system call: the kill lands after everything before the
# rename was written and before the rename, a window of microseconds that no poll from outside could hit.
KILL_AT_RENAME = "WEIGHTSTREAM_TEST_KILL_AT_RENAME"
_HOOK = f'''"""Written by tests/fault_support.py: SIGKILL this process as it renames anything onto ${KILL_AT_RENAME}."""
import os
import signal
import sys

_target = os.environ.get("{KILL_AT_RENAME}")
if _target:

    def _kill_at_rename(event, args):
        if event == "os.rename" and os.path.abspath(os.fsdecode(args[1])) == _target:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(_kill_at_rename)
'''


def kills(default: int) -> int:
    """`default`, or the number of kill points WEIGHTSTREAM_FAULT_KILLS asks for (each operation)."""
    value = os.environ.get(KILLS_VARIABLE, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{KILLS_VARIABLE}={value!r}: give a whole number of kill points, 1 or more")
    return int(value)


@dataclass(slots=True)
class Run:
    """One run of the command: killed (by the trigger, or by the hook at a rename) or finished on its own."""

    code: int
    stderr: str
    seconds: float
    triggered: bool  # the trigger fired and this test sent SIGKILL

    @property
    def killed(self) -> bool:
        return self.code == -signal.SIGKILL


def run_killed(
    args: list, folder, trigger: Callable[[float], bool] | None = None, kill_at_rename: str | None = None
) -> Run:
    """`weightstream ARGS` in a new process, polled every 2 ms: SIGKILLed when `trigger(seconds since start)` first
    returns True; with `kill_at_rename`, the process SIGKILLs itself as it renames anything onto that path (`_HOOK`).
    `folder` holds the hook and the run's stderr. A run still going after RUN_LIMIT_S fails the test."""
    env = dict(os.environ)
    os.makedirs(folder, exist_ok=True)
    if kill_at_rename is not None:
        hooks = os.path.join(folder, "hook")
        os.makedirs(hooks)
        with open(os.path.join(hooks, "sitecustomize.py"), "w") as f:
            f.write(_HOOK)
        env["PYTHONPATH"] = hooks + os.pathsep + env.get("PYTHONPATH", "")
        env[KILL_AT_RENAME] = os.path.abspath(kill_at_rename)
    err_path = os.path.join(folder, "stderr.txt")
    start = time.monotonic()
    triggered = False
    with open(err_path, "w") as err:
        proc = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                assert elapsed < RUN_LIMIT_S, f"weightstream {args[0]}: still running after {RUN_LIMIT_S} s"
                if trigger is not None and trigger(elapsed):
                    proc.send_signal(signal.SIGKILL)
                    triggered = True
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None and not triggered:
                proc.kill()
            proc.wait()
    with open(err_path) as f:
        return Run(proc.returncode, f.read(), time.monotonic() - start, triggered)


def entries(path) -> int:
    """How many entries the directory holds now; 0 when it is gone (renamed into place, or removed)."""
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def inode(path) -> tuple[int, int] | None:
    """(inode, modification time) of `path`, None where nothing is: a directory or file replaced shows here."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextlib.contextmanager
def tmpfs(path, size: int) -> Iterator[str]:
    """A tmpfs of `size` bytes mounted at `path` (created), unmounted at the end. Skips the test, saying why, where
    this process may not mount one; where it may, checks that writing past `size` really fails with ENOSPC."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        probe = os.path.join(path, "probe")
        with pytest.raises(OSError) as full, open(probe, "wb") as f:
            f.write(b"\0" * (size + 4096))
            f.flush()
        assert full.value.errno == errno.ENOSPC, full.value
        os.unlink(probe)
        yield str(path)
    finally:  # lazily where a model loaded in this process still maps a file there: gone once it is closed
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(path: str, leave: int = 0) -> str:
    """A file in `path` that takes all its free space but `leave` bytes (rounded down to pages); its path."""
    st = os.statvfs(path)
    filler = os.path.join(path, "filler")
    with open(filler, "wb") as f:
        f.write(b"\1" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler
