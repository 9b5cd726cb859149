"""Memory cgroups: the one a process runs in, read (its limit, what is charged to it now, its reclaimable page
cache), and child cgroups made for a run (`MemoryCgroup`: bench's children, an expert shard's own).

Both cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes, memory.usage_in_bytes). Page cache counts
against a cgroup's limit. A child cgroup has a hard limit and no swap: v2 where this process's cgroup has the memory
controller (memory.max, swap.max 0), v1 otherwise (limit_in_bytes, memsw.limit_in_bytes where the kernel has it,
swappiness 0). The limit counts the page cache too, so a run limited to L bytes keeps at most L of model pages.
Creating one needs root.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from weightstream.errors import WeightstreamError

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60
_MIB = 1 << 20

# What a cgroup charges beyond the resident set once the file pages are settled (`settle_file_pages`): kernel
# memory (page tables, slab: 17-18 MiB at 1 GiB), the page cache of small files read later, and the allocator's
# slack after growth. Measured in docs/memory.md.
MARGIN_BYTES = 48 * _MIB
MARGIN_SHARE = 0.02  # of SIZE, for the slack that grows with the heap


def margin_for(memory: int) -> int:
    """What a process given `memory` bytes keeps free of its resident set for what a cgroup of that size charges
    beyond it (`--memory` sizes its cache with it; `tune` budgets with it)."""
    return MARGIN_BYTES + int(MARGIN_SHARE * memory)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return _UNLIMITED if text == "max" else int(text)


def _stat_field(path: Path, names: tuple[str, ...]) -> int:
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in names:
                return int(parts[1])
    except OSError:
        pass
    return 0


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory cgroup a process is in: its directory and whether it is v1 or v2."""

    path: Path
    v2: bool

    @classmethod
    def of(cls, pid: int | str = "self", root: Path = CGROUP_ROOT) -> CgroupMemory | None:
        """The process's memory cgroup, or None when there is no memory controller."""
        v2_controllers = (
            (root / "cgroup.controllers").read_text().split() if (root / "cgroup.controllers").exists() else []
        )
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if controllers == "" and "memory" in v2_controllers:
                return cls(root / rel.lstrip("/"), True)
            if "memory" in controllers.split(","):
                return cls(root / "memory" / rel.lstrip("/"), False)
        return None

    @property
    def limit(self) -> int:
        """The byte limit (very large when unlimited)."""
        return _read_int(self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")) or _UNLIMITED

    @property
    def usage(self) -> int:
        """Bytes charged now, page cache included."""
        return _read_int(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")) or 0

    @property
    def inactive_file(self) -> int:
        """Page cache the kernel will reclaim first."""
        return _stat_field(self.path / "memory.stat", ("inactive_file", "total_inactive_file"))

    @property
    def limited(self) -> bool:
        """Whether a limit below the machine's memory applies."""
        return self.limit < meminfo_bytes("MemTotal")


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (`MemTotal`, `MemAvailable`) in bytes; 0 where it cannot be read."""
    return _stat_field(Path("/proc/meminfo"), (f"{field}:",)) * 1024


class MemoryCgroup:
    """A memory cgroup made for one run: `popen`/`enter_argv` put a process in it, `remove` deletes it."""

    def __init__(self, path: Path, v2: bool, limit_bytes: int):
        self.path, self.v2, self.limit_bytes = path, v2, limit_bytes

    @classmethod
    def create(cls, limit_bytes: int, name: str = "weightstream", unique: bool = True) -> MemoryCgroup:
        """A new cgroup `name-<random>` under this process's own memory cgroup, limited to `limit_bytes`; with
        `unique` False, `name` itself, taken as it is where it exists (a restarted shard's)."""
        parent = CgroupMemory.of()
        if parent is None:
            raise WeightstreamError(
                "no cgroup memory controller on this machine; runs under a memory limit need "
                "one (cgroup v2 with memory delegated, or v1 mounted at /sys/fs/cgroup/memory)"
            )
        group = cls(parent.path / (f"{name}-{uuid.uuid4().hex[:8]}" if unique else name), parent.v2, limit_bytes)
        try:
            if parent.v2:
                _delegate_memory(parent.path)
            group.path.mkdir(exist_ok=not unique)
            group._set_limit()
        except OSError as exc:
            group.remove()
            raise WeightstreamError(
                f"cannot create memory cgroup {group.path} ({exc.strerror}); runs under a "
                "memory limit need root and a cgroup v1 or v2 memory controller"
            ) from None
        return group

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Start `args` inside the cgroup (it moves itself in before exec)."""
        procs = self.path / "cgroup.procs"
        return subprocess.Popen(args, preexec_fn=lambda: procs.write_text(str(os.getpid())), **kwargs)

    def enter_argv(self, argv: list[str]) -> list[str]:
        """`argv` wrapped in a shell that moves itself into the cgroup, then execs it (for tools that take argv)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *argv]

    @property
    def peak_bytes(self) -> int | None:
        """Peak bytes charged to the cgroup, page cache included."""
        try:
            return int((self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None

    @property
    def oom_kills(self) -> int | None:
        """Processes the kernel killed for running out of this cgroup's memory (v2 `memory.events`, v1
        `memory.oom_control`)."""
        try:
            for line in (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    @property
    def pressure(self) -> dict[str, int]:
        """What the limit cost the run so far, from the cgroup's own `memory.stat`: `major_faults` (pages read in
        on a fault: code, mapped weights) and `file_refaults` (file pages read back in soon after the kernel
        evicted them to stay under the limit: the run thrashed when this grows with it). Missing counters are
        left out."""
        wanted = {"pgmajfault": "major_faults", "workingset_refault_file": "file_refaults"}
        found: dict[str, int] = {}
        try:
            for line in (self.path / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in wanted:
                    found[wanted[key]] = int(value)
        except (OSError, ValueError):
            pass
        return found

    def remove(self) -> None:
        """Delete the cgroup; waits up to 5 s for the kernel to let go of its exited processes."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _set_limit(self) -> None:
        if self.v2:
            (self.path / "memory.max").write_text(str(self.limit_bytes))
            _write_if_exists(self.path / "memory.swap.max", "0")
        else:
            _write_if_exists(self.path / "memory.swappiness", "0")
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            _write_if_exists(self.path / "memory.memsw.limit_in_bytes", str(self.limit_bytes))


def _delegate_memory(parent: Path) -> None:
    """v2 limits a child only where its parent hands the memory controller down."""
    control = parent / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")


def _write_if_exists(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)
