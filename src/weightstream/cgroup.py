"""The memory cgroup a process runs in, read: its limit, what is charged to it now, its reclaimable page cache.

Both cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes, memory.usage_in_bytes) are read. Page
cache counts against a cgroup's limit. Read only: prefetch's memory headroom (`prefetch.memory`) and bench's child
cgroups (`bench.cgroup`, which makes them under this one) both start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
