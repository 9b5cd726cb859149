"""Fakes to run the clockfloor daemon without a GPU: a fake Jetson devfreq tree, a fake NVML, real child processes
(flagged burners and sleepers) and the daemon itself as a subprocess.

The clock tests (tests/clockfakes.py adds their pytest fixture) and benchmarks/clockfloor.py both use them; nothing
in the running daemon does. Every child `spawn` starts is remembered in SPAWNED, and `reap_spawned` ends them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import weightstream

SRC = str(Path(weightstream.__file__).resolve().parents[1])
SPAWNED: list[subprocess.Popen] = []  # every child a helper starts; reap_children ends them after each test
JETSON_HZ = [306000000, 408000000, 510000000, 612000000, 714000000, 816000000, 918000000, 1020000000]
BURN = "import time\nend = time.time() + float(__import__('sys').argv[1])\nwhile time.time() < end: pass\n"


def make_devfreq_tree(
    root: Path,
    name: str = "17000000.gpu",
    device: str = "17000000.ga10b",
    min_hz: int = 306000000,
    max_hz: int = 1020000000,
    others: bool = True,
) -> Path:
    """A sysfs root laid out like a Jetson's: class/devfreq/<name>/... with `device` linking to platform."""
    platform = root / "devices" / "platform"
    node = root / "class" / "devfreq" / name
    node.mkdir(parents=True)
    (platform / device / "of_node").mkdir(parents=True)
    (platform / device / "of_node" / "compatible").write_bytes(b"nvidia," + device.split(".")[-1].encode() + b"\0")
    os.symlink(os.path.relpath(platform / device, node), node / "device")
    files = {
        "min_freq": min_hz,
        "max_freq": max_hz,
        "cur_freq": min_hz,
        "governor": "nvhost_podgov",
        "available_frequencies": " ".join(map(str, JETSON_HZ)),
        "polling_interval": 0,
    }
    for field, value in files.items():
        (node / field).write_text(f"{value}\n")
    if others:  # a non-GPU devfreq node the finder must skip
        emc = root / "class" / "devfreq" / "13d00000.host1x"
        emc.mkdir()
        for field, value in files.items():
            (emc / field).write_text(f"{value}\n")
    return node


def read_hz(node: Path, field: str = "min_freq") -> int:
    """A fake node attribute as an integer (a plain file can be caught empty mid-write; real sysfs cannot)."""
    for _ in range(100):
        text = (node / field).read_text().strip()
        if text:
            return int(text)
        time.sleep(0.001)
    raise AssertionError(f"{node / field} stayed empty")


def snapshot_files(node: Path) -> dict[str, tuple[str, int]]:
    """Text and mtime of every attribute except min_freq: proves nothing else was written."""
    return {
        p.name: (p.read_text(), p.stat().st_mtime_ns)
        for p in sorted(node.iterdir())
        if p.is_file() and p.name != "min_freq"
    }


def write_config(path: Path, **keys) -> Path:
    """A KEY=value config file."""
    path.write_text("".join(f'{key}="{value}"\n' for key, value in keys.items()))
    return path


def _favour() -> None:
    # Shield timing tests from other work on a shared 2-core machine: a child that should burn CPU gets it,
    # and the daemon under test reacts on time. Needs CAP_SYS_NICE (root); elsewhere it is a no-op.
    try:
        os.nice(-10)
    except OSError:
        pass


def spawn(command: list[str], **kwargs) -> subprocess.Popen:
    """Popen at raised priority, remembered so that a failing test cannot leave it running."""
    process = subprocess.Popen(command, preexec_fn=_favour, **kwargs)
    SPAWNED.append(process)
    return process


def reap_spawned() -> None:
    """SIGTERM every child `spawn` started that is still running (a daemon restores its floor), then SIGKILL."""
    while SPAWNED:
        process = SPAWNED.pop()
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def burner(seconds: float, *flags: str) -> subprocess.Popen:
    """A real child burning one core for `seconds`, with `flags` in its argv."""
    return spawn([sys.executable, "-c", BURN, str(seconds), *flags])


def sleeper(seconds: float, *flags: str) -> subprocess.Popen:
    """A real child that carries `flags` but uses no CPU (after starting) for `seconds`."""
    return spawn([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))", str(seconds), *flags])


def wait_for(predicate, timeout: float, step: float = 0.01) -> float | None:
    """Seconds until predicate() held, or None after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(step)
    return None


class DaemonProcess:
    """`weightstream clockfloor` as a real subprocess, its output lines collected by a thread."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "weightstream.cli", "clockfloor", *args]
        self.process = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, timeout: float = 20.0) -> str:
        """The first output line containing text; fails the test with the output so far if none comes."""
        found = wait_for(lambda: any(text in line for line in self.lines), timeout)
        if found is None:
            raise AssertionError(f"no line with {text!r} in {timeout} s; output:\n" + "\n".join(self.lines))
        return next(line for line in self.lines if text in line)

    def stop(self, signum: int = 15, timeout: float = 10.0) -> int:
        """Send a signal and wait for the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
        status = self.process.wait(timeout=timeout)
        self._pump_thread.join(timeout)  # every line the daemon printed is in self.lines
        return status

    def output(self) -> str:
        """All lines so far."""
        return "\n".join(self.lines)


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


class FakeNvml:
    """The pynvml functions the NVML backend calls, recording every clock change."""

    NVMLError = FakeNvmlError
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_MEM = 2

    def __init__(self, graphics=(210, 600, 1005, 1410, 1980), memory=(1593, 2619), fail_init: bool = False):
        self.graphics, self.memory, self.fail_init = list(graphics), list(memory), fail_init
        self.calls: list[tuple] = []
        self.locked: tuple[int, int] | None = None

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")
        self.calls.append(("init",))

    def nvmlShutdown(self):
        self.calls.append(("shutdown",))

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return b"Fake H200"

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return max(self.graphics) if kind == self.NVML_CLOCK_GRAPHICS else max(self.memory)

    def nvmlDeviceGetSupportedMemoryClocks(self, handle):
        return list(self.memory)

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle, memory_mhz):
        if memory_mhz not in self.memory:
            raise AssertionError("graphics clocks are listed per supported memory clock")
        return sorted(self.graphics, reverse=True)

    def nvmlDeviceSetGpuLockedClocks(self, handle, min_mhz, max_mhz):
        self.calls.append(("lock", min_mhz, max_mhz))
        self.locked = (min_mhz, max_mhz)

    def nvmlDeviceResetGpuLockedClocks(self, handle):
        self.calls.append(("reset",))
        self.locked = None
