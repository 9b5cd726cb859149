"""Run a child process inside a memory cgroup (v2 where it has the memory controller, v1 otherwise), drop a
model's files from the page cache, and read a block device's own counters.

The cgroup limit counts the page cache too, so a run limited to L bytes keeps at most L of model pages; there
is no swap: memsw (v1) / swap.max (v2) is set to the same limit where the kernel offers it.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass

from weightstream.errors import WeightstreamError

V2_ROOT = "/sys/fs/cgroup"
V1_ROOT = "/sys/fs/cgroup/memory"


@dataclass(slots=True)
class MemoryCgroup:
    """A child cgroup with a hard memory limit; `popen` starts a process inside it."""

    path: str
    version: int
    limit_bytes: int

    @classmethod
    def create(cls, limit_bytes: int, name: str = "weightstream") -> MemoryCgroup:
        parent, version = _parent()
        path = os.path.join(parent, f"{name}-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(path)
            group = cls(path, version, limit_bytes)
            group._set_limit()
        except OSError as exc:
            raise WeightstreamError(f"cannot create a memory cgroup under {parent} ({exc.strerror}); "
                                    "`weightstream bench` needs root and a cgroup v1 or v2 memory controller") from exc
        return group

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        procs = os.path.join(self.path, "cgroup.procs")
        return subprocess.Popen(args, preexec_fn=lambda: _write(procs, str(os.getpid())), **kwargs)

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.path, name)))
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for _ in range(50):  # the kernel frees the group a moment after its last process exits
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def _set_limit(self) -> None:
        if self.version == 2:
            _write(os.path.join(self.path, "memory.max"), str(self.limit_bytes))
            _write_if_exists(os.path.join(self.path, "memory.swap.max"), "0")
        else:
            _write_if_exists(os.path.join(self.path, "memory.swappiness"), "0")
            _write(os.path.join(self.path, "memory.limit_in_bytes"), str(self.limit_bytes))
            _write_if_exists(os.path.join(self.path, "memory.memsw.limit_in_bytes"), str(self.limit_bytes))


def _parent() -> tuple[str, int]:
    """Our own cgroup, as a place to nest children: v2 when it delegates memory, else the v1 memory hierarchy."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    v2 = next((p for h, c, p in lines if h == "0"), None)
    if v2 is not None and "memory" in _read(os.path.join(V2_ROOT, "cgroup.controllers"), "").split():
        return os.path.join(V2_ROOT, v2.lstrip("/")), 2
    v1 = next((p for h, c, p in lines if "memory" in c.split(",")), None)
    if v1 is None or not os.path.isdir(V1_ROOT):
        raise WeightstreamError("no cgroup memory controller on this machine; `weightstream bench` needs one "
                                "(cgroup v2 with memory delegated, or v1 mounted at /sys/fs/cgroup/memory)")
    return os.path.join(V1_ROOT, v1.lstrip("/")), 1


def drop_from_page_cache(paths: list[str]) -> bool:
    """Evict the files' pages (fadvise DONTNEED), then drop clean caches system-wide when root. True if global."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        _write("/proc/sys/vm/drop_caches", "1")
        return True
    except OSError:
        return False


def block_device_of(path: str) -> str:
    """The /sys/dev/block entry (major:minor) of the device holding `path`."""
    st = os.stat(path)
    return f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def device_bytes_read(device: str) -> int | None:
    """Bytes the device has read since boot (sectors of 512 bytes, from its own stat counters)."""
    try:
        return int(_read(os.path.join(device, "stat")).split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


def _read(path: str, default: str | None = None) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        if default is None:
            raise
        return default


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _write_if_exists(path: str, value: str) -> None:
    if os.path.exists(path):
        _write(path, value)
