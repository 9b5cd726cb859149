"""Memory headroom for prefetch: the system's and the memory cgroup's a process runs in (`weightstream.cgroup`
reads it). Page cache counts against a cgroup's limit, so prefetched pages are charged to the wrapper's cgroup.
"""

from __future__ import annotations

from weightstream.cgroup import CgroupMemory, meminfo_bytes


def under_pressure(cgroup: CgroupMemory | None, floor: int) -> bool:
    """Whether prefetching more would force reclaim: MemAvailable below floor, or, in a memory-limited cgroup,
    less than min(floor, 5% of the limit) actually free under the limit.

    In a cgroup the free room is what counts, not what reclaim could make free: page cache fills a cgroup up
    to its limit, and filling it further means the kernel evicts something (often what we just prefetched,
    and always in the loader's own allocations' path). Burn-after-reading is what makes room again.
    """
    if meminfo_bytes("MemAvailable") < floor:
        return True
    if cgroup is not None and cgroup.limited:
        return cgroup.limit - cgroup.usage < min(floor, cgroup.limit // 20)
    return False
