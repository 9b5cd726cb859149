"""The paths that do not need tracefs, run for real: residency sampling, NUMA choice, memory cgroups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from weightstream.errors import WeightstreamError
from weightstream.prefetch import numa

from cgroup_support import cgroup_or_skip
from prefetch_support import cli, drop, env_with_home, files, loader, make_checkpoint

pytestmark = pytest.mark.usefixtures("no_proactive_reclaim")  # counts cached pages or bytes read

SPEC = ["--spec", "model=fallback"]


def test_residency_sampling_record_and_run(tmp_path):
    ckpt = make_checkpoint(tmp_path / "model")
    paths, home = files(ckpt), tmp_path / "home"
    drop(paths)
    want = subprocess.run(loader("read", paths, "--sleep-per-mib", "0.002"), capture_output=True).stdout
    rec = cli(
        home,
        "prefetch",
        "record",
        *SPEC,
        "--sampling",
        "--model-dir",
        str(ckpt),
        "--",
        *loader("read", paths, "--sleep-per-mib", "0.002"),
    )
    assert rec.returncode == 0 and rec.stdout == want, rec.stderr.decode()
    assert b"recording with residency events" in rec.stderr and b"cannot tell processes apart" in rec.stderr
    report = tmp_path / "r.json"
    drop(paths)
    run = cli(home, "prefetch", "run", *SPEC, "--sampling", "--json-report", str(report), "--", *loader("mmap", paths))
    assert run.returncode == 0 and run.stdout == want
    doc = json.loads(report.read_text())
    assert doc["template_used"] and doc["source"] == "residency" and doc["bytes_used"] is None
    assert doc["bytes_prefetched"] + doc["bytes_loader_missed"] >= sum(os.path.getsize(p) for p in paths) // 2


def _fake_sysfs(root, nodes: dict[int, str], gpus: list[tuple[str, int]]):
    for n, cpus in nodes.items():
        (root / "devices/system/node" / f"node{n}").mkdir(parents=True)
        (root / "devices/system/node" / f"node{n}/cpulist").write_text(cpus + "\n")
    for bdf, node in gpus:
        d = root / "bus/pci/devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "numa_node").write_text(f"{node}\n")
    return root


def test_numa_auto_follows_the_visible_gpu(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, [("0000:17:00.0", 0), ("0000:b3:00.0", 1)])
    p = numa.choose("auto", sysfs, {"CUDA_VISIBLE_DEVICES": "1"})
    assert p.node == 1 and p.cpus == (4, 5, 6, 7) and "0000:b3:00.0" in p.message
    assert numa.choose("auto", sysfs, {}).node == 0
    assert numa.choose("1", sysfs).cpus == (4, 5, 6, 7)
    with pytest.raises(WeightstreamError, match="does not exist"):
        numa.choose("2", sysfs)
    assert numa.choose("auto", _fake_sysfs(tmp_path / "nogpu", {0: "0-1", 1: "2-3"}, [])).node is None


def test_single_node_machine_says_so_and_carries_on(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {0: "0-1"}, [("0000:01:00.0", 0)])
    p = numa.choose("auto", sysfs, {})
    assert p.node is None and "single NUMA node" in p.message
    real = numa.choose("0")  # this machine
    assert real.node is None or len(numa.online_nodes()) > 1


def test_bind_sets_the_threads_memory_policy():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    got = {}

    def bound():
        numa.bind_current_thread(numa.Placement(0, tuple(sorted(os.sched_getaffinity(0))), ""))
        mode, mask = ctypes.c_int(-1), ctypes.c_ulong(0)
        assert libc.syscall(239, ctypes.byref(mode), ctypes.byref(mask), 64, None, 0) == 0  # get_mempolicy
        got.update(mode=mode.value, mask=mask.value)

    t = threading.Thread(target=bound)
    t.start()
    t.join()
    assert got == {"mode": 1, "mask": 1}  # MPOL_PREFERRED, node 0


def test_run_inside_a_memory_limited_cgroup(tmp_path):
    ckpt = make_checkpoint(tmp_path / "model", {"a.safetensors": 48 << 20, "b.safetensors": 48 << 20})
    paths, home = files(ckpt), tmp_path / "home"
    want = subprocess.run(loader("read", paths), capture_output=True).stdout
    assert (
        cli(home, "prefetch", "record", *SPEC, "--model-dir", str(ckpt), "--", *loader("read", paths)).returncode == 0
    )
    cg = cgroup_or_skip(400 << 20)
    try:
        drop(paths)
        argv = cg.enter_argv(
            [
                sys.executable,
                "-m",
                "weightstream.cli",
                "prefetch",
                "run",
                *SPEC,
                "--",
                *loader("read", paths, "--sleep-per-mib", "0.002"),
            ]
        )
        out = subprocess.run(argv, env=env_with_home(home), capture_output=True, timeout=120)
        assert out.returncode == 0 and out.stdout == want, out.stderr.decode()
        assert b"memory cgroup limit 400.0 MiB: prefetch budget" in out.stderr
        assert cg.peak_bytes is not None and cg.peak_bytes <= 400 << 20
    finally:
        cg.remove()
    assert not cg.path.exists()


def test_cgroup_counts_its_oom_kills():
    """Benchmarks tell an out-of-memory kill from any other death by the cgroup's own counter."""
    cg = cgroup_or_skip(64 << 20)
    try:
        assert cg.oom_kills == 0
        proc = cg.popen([sys.executable, "-c", "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])"])
        assert proc.wait(timeout=60) == -9
        assert cg.oom_kills == 1
    finally:
        cg.remove()


def test_cgroup_counts_the_reclaim_its_limit_forces(tmp_path):
    """bench reports what a limit cost a run: reading a file twice that is larger than the limit makes the kernel
    evict under the limit and read the evicted pages back in; before the run the counters are 0."""
    data = tmp_path / "big.bin"
    data.write_bytes(os.urandom(1 << 20) * 96)
    read_twice = (
        "import mmap, sys\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "for _ in range(2):\n"
        "    sum(m[i] for i in range(0, len(m), 4096))\n"
    )
    cg = cgroup_or_skip(48 << 20)
    try:
        assert cg.pressure == {"major_faults": 0, "file_refaults": 0}
        drop([str(data)])
        assert cg.popen([sys.executable, "-c", read_twice, str(data)]).wait(timeout=120) == 0
        after = cg.pressure
        assert after["file_refaults"] > 0 and after["major_faults"] > 0, after
    finally:
        cg.remove()
