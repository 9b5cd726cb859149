"""What a benchmark ran on: the machine, and the block device holding the model with its own read counter."""

from __future__ import annotations

import os
import platform

import psutil


def block_device_of(path: str) -> str:
    """The /sys/dev/block entry (major:minor) of the device holding `path`."""
    st = os.stat(path)
    return f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def device_bytes_read(device: str) -> int | None:
    """Bytes the device has read since boot (sectors of 512 bytes, from its own stat counters)."""
    try:
        with open(os.path.join(device, "stat")) as f:
            return int(f.read().split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


def read_ahead_bytes(path: str) -> int | None:
    """The kernel's readahead window for files on the device holding `path` (its queue's `read_ahead_kb`; a
    partition's is its disk's), or None where sysfs does not say."""
    device = os.path.realpath(block_device_of(path))
    for queue in (os.path.join(device, "queue"), os.path.join(os.path.dirname(device), "queue")):
        try:
            with open(os.path.join(queue, "read_ahead_kb")) as f:
                return int(f.read()) * 1024
        except (OSError, ValueError):
            continue
    return None


def machine_info(device: str) -> dict:
    """CPUs, memory, kernel, Python, and the disk the model is on."""
    model_path = os.path.join(device, "device", "model")
    disk = None
    if os.path.exists(model_path):
        with open(model_path) as f:
            disk = f.read().strip()
    from weightstream.bench.reclaim import proactive_reclaim_state

    return {
        "cpus": os.cpu_count(),
        "proactive_reclaim": proactive_reclaim_state(),  # DAMON pageout: measured runs pause it (bench.reclaim)
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "block_device": os.path.basename(os.path.realpath(device)),  # its name (vda): no machine path in results
        "disk_model": disk,
    }


def read_bandwidth(refresh: bool = False) -> float:
    """Bytes per second this machine reads memory at: a float32 sum over 1 GiB on torch's threads, best of 5.
    Measured once (about 2 s) and kept beside tune's calibrations, keyed by CPU model, core count, memory and
    thread count; `refresh` measures again."""
    import json
    import time
    from pathlib import Path

    import torch

    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{psutil.virtual_memory().total}|" + str(
        torch.get_num_threads()
    )
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightstream" / "read-bandwidth.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if not refresh and isinstance(saved.get(key), (int, float)) and saved[key] > 0:
        return float(saved[key])
    t = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - start)
    saved[key] = t.nbytes / best
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved))
    os.replace(tmp, path)
    return saved[key]
