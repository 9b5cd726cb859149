"""NUMA placement of prefetched pages: which node, and binding a prefetch thread to it.

Page-cache pages are allocated by the task that reads them, under its memory policy, so a prefetch thread
that runs on node N's CPUs with set_mempolicy(MPOL_PREFERRED, N) puts what it reads on node N. With "auto"
the node is the one of the accelerator the command will use (CUDA_VISIBLE_DEVICES, else the first NVIDIA
PCI device), read from sysfs; sysfs_root is a parameter so tests can point it at a fake tree.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from weightstream.errors import WeightstreamError

_SYS_SET_MEMPOLICY = 238  # x86-64
_MPOL_PREFERRED = 1
_NVIDIA = "0x10de"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True, slots=True)
class Placement:
    """The node to place pages on (None: leave placement to the kernel) and what to tell the user."""

    node: int | None
    cpus: tuple[int, ...]
    message: str


def _cpulist(text: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def online_nodes(sysfs: Path = Path("/sys")) -> dict[int, tuple[int, ...]]:
    """node -> CPUs, for the nodes that have memory."""
    base = sysfs / "devices" / "system" / "node"
    nodes = {}
    for d in sorted(base.glob("node[0-9]*")):
        cpulist = d / "cpulist"
        nodes[int(d.name[4:])] = _cpulist(cpulist.read_text()) if cpulist.exists() else ()
    return nodes or {0: tuple(range(os.cpu_count() or 1))}


def accelerator_node(sysfs: Path = Path("/sys"), env: dict | None = None) -> tuple[int | None, str]:
    """The NUMA node of the NVIDIA GPU the command will use, and which device that was."""
    env = os.environ if env is None else env
    gpus = sorted(
        d
        for d in (sysfs / "bus" / "pci" / "devices").glob("*")
        if _read(d / "vendor") == _NVIDIA and _read(d / "class").startswith("0x03")
    )
    if not gpus:
        return None, "no NVIDIA accelerator found in sysfs"
    visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    index = int(visible) if visible.isdigit() and int(visible) < len(gpus) else 0
    node = int(_read(gpus[index] / "numa_node") or -1)
    return (node if node >= 0 else None), f"GPU {index} at PCI {gpus[index].name}"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def choose(request: str | None, sysfs: Path = Path("/sys"), env: dict | None = None) -> Placement:
    """Resolve --numa-node (a number, "auto" or None) to a Placement; a node that does not exist is an error."""
    nodes = online_nodes(sysfs)
    if request is None:
        return Placement(None, (), "")
    if request == "auto":
        node, which = accelerator_node(sysfs, env)
        if node is None:
            return Placement(None, (), f"NUMA auto: {which}; pages go where the kernel puts them")
    elif request.isdigit():
        node, which = int(request), "requested"
        if node not in nodes:
            raise WeightstreamError(f"--numa-node {node} does not exist; this machine has nodes {sorted(nodes)}")
    else:
        raise WeightstreamError(f"--numa-node {request!r} is not a node number or 'auto'")
    if len(nodes) == 1:
        return Placement(None, (), f"single NUMA node (node {node}, {which}): nothing to place; carrying on")
    return Placement(node, nodes[node], f"prefetched pages go to NUMA node {node} ({which})")


def bind_current_thread(placement: Placement) -> None:
    """Run this thread on the node's CPUs and prefer the node for its page allocations."""
    if placement.node is None:
        return
    if placement.cpus:
        os.sched_setaffinity(0, placement.cpus)
    mask = ctypes.c_ulong(1 << placement.node)
    if _libc.syscall(_SYS_SET_MEMPOLICY, _MPOL_PREFERRED, ctypes.byref(mask), 64) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy failed")
