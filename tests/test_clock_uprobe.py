"""uprobe detection for real: bpftrace on a libllama.so built here, called by real decode loops.

Needs gcc, bpftrace (scripts/install-bpftrace.sh installs it), root, and a kernel that permits uprobes;
where any is missing every test here skips with the precise reason.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from weightstream.clock.uprobe import unavailable_reason

from clockfakes import (
    DaemonProcess,
    make_devfreq_tree,
    read_hz,
    reap_children,  # noqa: F401  autouse fixture: ends every child a test started
    spawn,
    wait_for,
    write_config,
)

SOURCES = Path(__file__).parent / "clock_uprobe"
IDLE_HZ, FLOOR_HZ, HOLD_S, RESCAN_S = 306000000, 1020000000, 1.0, 1.0


def build_library(directory: Path) -> Path:
    """Compile libllama.so into directory, replacing any previous build by rename (a new inode, like make)."""
    fresh = directory / "libllama.so.new"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(fresh), str(SOURCES / "libllama.c")], check=True)
    os.replace(fresh, directory / "libllama.so")
    return directory / "libllama.so"


def uprobe_skip_reason(directory: Path) -> str | None:
    """None when a real uprobe fires here; else exactly why not."""
    if shutil.which("gcc") is None:
        return "gcc not found: cannot build the test libllama.so"
    reason = unavailable_reason()
    if reason:
        return f"{reason}; scripts/install-bpftrace.sh sets the tests up"
    library = build_library(directory)
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-o",
            str(directory / "decode_loop"),
            str(SOURCES / "decode_loop.c"),
            f"-L{directory}",
            "-lllama",
            f"-Wl,-rpath,{directory}",
        ],
        check=True,
    )
    loop = subprocess.Popen([str(directory / "decode_loop"), "0", "5000"])
    try:
        trial = subprocess.run(
            ["bpftrace", "-B", "none", "-e", f'uprobe:{library}:llama_decode {{ printf("hit\\n"); exit(); }}'],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return "bpftrace attached no uprobe within 30 s"
    finally:
        loop.kill()
        loop.wait()
    if "hit" not in trial.stdout:
        return f"uprobes not permitted here: bpftrace exited {trial.returncode}: {trial.stderr.strip()[-400:]}"
    return None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The built library and loop program, or a skip with the reason printed."""
    directory = tmp_path_factory.mktemp("uprobe")
    reason = uprobe_skip_reason(directory)
    if reason:
        print(f"SKIP uprobe tests: {reason}")
        pytest.skip(reason)
    return directory


@pytest.fixture
def jetson(tmp_path):
    return tmp_path, make_devfreq_tree(tmp_path / "sys")


def start(jetson, lab, wait_for_line, **keys):
    root, _ = jetson
    config = write_config(
        root / "c.conf",
        STATE_FILE=root / "state.json",
        SOCKET=root / "a.sock",
        DETECT="uprobe",
        HOLD=HOLD_S,
        RESCAN=RESCAN_S,
        **keys,
    )
    daemon = DaemonProcess("--config", str(config), "--sysfs-root", str(root / "sys"))
    daemon.wait_line(wait_for_line)
    return daemon


def decode_loop(lab: Path, call_us: int, gap_us: int, *flags: str) -> subprocess.Popen:
    return spawn([str(lab / "decode_loop"), str(call_us), str(gap_us), *flags])


def finish(*processes):
    for process in processes:
        process.kill()
        process.wait()


def test_only_flagged_callers_count_and_a_long_call_holds_the_floor(jetson, lab):
    _, node = jetson
    daemon = start(jetson, lab, "uprobes: attached", LIBRARIES=lab / "libllama.so")
    plain = decode_loop(lab, 0, 5000)
    try:
        assert wait_for(lambda: read_hz(node) != IDLE_HZ, 1.5) is None, daemon.output()
        flagged = decode_loop(lab, 0, 20000, "--cpu-moe")
        assert wait_for(lambda: read_hz(node) == FLOOR_HZ, 1.5) is not None, daemon.output()
        daemon.wait_line(f"floor 1020 MHz (pid {flagged.pid} inference, uprobe --cpu-moe)", timeout=5)
        finish(flagged)
        assert wait_for(lambda: read_hz(node) == IDLE_HZ, HOLD_S + 1.0) is not None, daemon.output()
        slow = decode_loop(lab, 3_000_000, 0, "-cmoe")  # 3 s inside llama_decode, no events meanwhile
        assert wait_for(lambda: read_hz(node) == FLOOR_HZ, 1.5) is not None, daemon.output()
        assert wait_for(lambda: read_hz(node) != FLOOR_HZ, 2.0 * HOLD_S) is None, "dropped during a long call"
        finish(slow)
        assert wait_for(lambda: read_hz(node) == IDLE_HZ, HOLD_S + 1.0) is not None, daemon.output()
    finally:
        finish(plain)
        assert daemon.stop() == 0


def test_libraries_are_found_in_flagged_processes_and_bpftrace_stops_with_the_daemon(jetson, lab):
    _, node = jetson
    daemon = start(jetson, lab, "detecting by uprobe")
    flagged = decode_loop(lab, 0, 20000, "--n-cpu-moe", "30")
    try:
        assert wait_for(lambda: read_hz(node) == FLOOR_HZ, RESCAN_S + 1.5) is not None, daemon.output()
        daemon.wait_line(f"uprobes: attaching to {lab / 'libllama.so'} (llama_decode, llama_synchronize)", timeout=5)
        bpftrace_pids = (
            [
                pid
                for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if (Path(f"/proc/{pid}/stat").read_text().split()[3:4] or [""])[0] == str(daemon.process.pid)
            ]
            if Path(f"/proc/{daemon.process.pid}").exists()
            else []
        )
        assert bpftrace_pids, "bpftrace should run as the daemon's child"
        assert daemon.stop() == 0
        assert read_hz(node) == IDLE_HZ
        assert not any(Path(f"/proc/{pid}").exists() for pid in bpftrace_pids), "bpftrace outlived the daemon"
    finally:
        finish(flagged)


def test_a_rebuilt_library_is_attached_again(jetson, lab):
    _, node = jetson
    daemon = start(jetson, lab, "uprobes: attached", LIBRARIES=lab / "libllama.so")
    try:
        build_library(lab)  # new inode at the same path; the old probes watch the old file
        assert wait_for(lambda: daemon.output().count("uprobes: attached") == 2, RESCAN_S + 3.0) is not None, (
            daemon.output()
        )
        flagged = decode_loop(lab, 0, 20000, "--cpu-moe")
        try:
            assert wait_for(lambda: read_hz(node) == FLOOR_HZ, 1.5) is not None, daemon.output()
        finally:
            finish(flagged)
    finally:
        assert daemon.stop() == 0
