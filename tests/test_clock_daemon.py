"""The daemon as a real subprocess on a fake Jetson devfreq tree, driven by real child processes."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from clockfakes import (
    SRC,
    DaemonProcess,
    burner,
    make_devfreq_tree,
    read_hz,
    reap_children,  # noqa: F401  autouse fixture: ends every child a test started
    sleeper,
    snapshot_files,
    wait_for,
    write_config,
)

IDLE_HZ, FLOOR_HZ, HOLD_S = 306000000, 1020000000, 1.0


@pytest.fixture
def jetson(tmp_path):
    """A fake sysfs root, its GPU node, and a config whose state and socket live in tmp_path."""
    node = make_devfreq_tree(tmp_path / "sys")
    config = write_config(
        tmp_path / "clockfloor.conf", STATE_FILE=tmp_path / "state.json", SOCKET=tmp_path / "activity.sock", HOLD=HOLD_S
    )
    return tmp_path, node, config


def start_daemon(jetson, *extra):
    root, _, config = jetson
    daemon = DaemonProcess("--config", str(config), "--sysfs-root", str(root / "sys"), *extra)
    daemon.wait_line("detecting by")
    return daemon


def test_busy_flagged_child_raises_floor_and_its_exit_restores_it(jetson):
    root, node, _ = jetson
    untouched = snapshot_files(node)
    daemon = start_daemon(jetson)
    try:
        child = burner(2.5, "--cpu-moe")
        raised_after = wait_for(lambda: read_hz(node) == FLOOR_HZ, 1.5)
        assert raised_after is not None, daemon.output()
        state = json.loads((root / "state.json").read_text())
        assert state["original"] == IDLE_HZ and state["raised"] == FLOOR_HZ and state["pid"] == daemon.process.pid
        child.wait()
        restored_after = wait_for(lambda: read_hz(node) == IDLE_HZ, HOLD_S + 1.0)
        assert restored_after is not None, daemon.output()
        assert restored_after >= HOLD_S / 2, "restored before the hold could elapse"
        daemon.wait_line("floor 306 MHz (idle)")
        daemon.wait_line(f"floor 1020 MHz (pid {child.pid} inference, poll --cpu-moe)", timeout=5)
        assert not (root / "state.json").exists()
        assert snapshot_files(node) == untouched  # max_freq, governor, cur_freq: not even rewritten
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_restores_the_floor_while_inference_runs(jetson, signum):
    root, node, _ = jetson
    daemon = start_daemon(jetson, "--floor", "700")
    child = burner(30, "-ncmoe", "12")
    try:
        assert wait_for(lambda: read_hz(node) == 714000000, 1.5) is not None, daemon.output()
        assert daemon.stop(signum) == 0
        assert read_hz(node) == IDLE_HZ
        daemon.wait_line(f"floor 306 MHz ({signal.Signals(signum).name})", timeout=5)
        assert not (root / "state.json").exists()
    finally:
        child.kill()
        child.wait()


def test_stale_state_file_is_repaired_at_start(jetson):
    root, node, _ = jetson
    (node / "min_freq").write_text(f"{FLOOR_HZ}\n")
    stale = {"backend": "devfreq", "node": str(node), "original": IDLE_HZ, "raised": FLOOR_HZ, "pid": 4194000}
    (root / "state.json").write_text(json.dumps(stale))
    daemon = start_daemon(jetson)
    try:
        daemon.wait_line("repaired a floor left raised by pid 4194000: min_freq back to 306 MHz", timeout=5)
        assert read_hz(node) == IDLE_HZ and not (root / "state.json").exists()
    finally:
        assert daemon.stop() == 0


def test_processes_without_the_flags_or_without_cpu_never_raise_it(jetson):
    _, node, _ = jetson
    daemon = start_daemon(jetson)
    children = [sleeper(4, "--cpu-moe"), burner(4, "--cpu-moes"), burner(4, "--gpu-moe", "cmoe")]
    try:
        raised = wait_for(lambda: read_hz(node) != IDLE_HZ, 3.0)
        assert raised is None, daemon.output()
        assert not [line for line in daemon.lines if line.startswith("floor ")], daemon.output()
        assert all(child.poll() is None for child in children), "a child ended early: the test proved nothing"
    finally:
        assert daemon.stop() == 0


def test_a_second_daemon_is_refused_and_changes_nothing(jetson):
    root, _, config = jetson
    daemon = start_daemon(jetson)
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightstream.cli",
                "clockfloor",
                "--config",
                str(config),
                "--sysfs-root",
                str(root / "sys"),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=SRC),
            timeout=30,
        )
        assert second.returncode == 2
        assert f"another clockfloor daemon (pid {daemon.process.pid})" in second.stderr
        assert (root / "activity.sock").exists()  # the first daemon's socket was not taken over
    finally:
        assert daemon.stop() == 0


def test_once_raises_during_inference_and_restores_before_exit(jetson):
    root, node, config = jetson
    child = burner(6, "--n-cpu-moe=20")
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightstream.cli",
                "clockfloor",
                "--once",
                "--config",
                str(config),
                "--sysfs-root",
                str(root / "sys"),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=SRC),
            timeout=30,
        )
    finally:
        child.kill()
        child.wait()
    assert result.returncode == 0, result.stderr
    assert f"floor 1020 MHz (pid {child.pid} inference, poll --n-cpu-moe)" in result.stdout
    assert "floor 306 MHz (window over)" in result.stdout
    assert f"once: inference seen: pid {child.pid} (poll --n-cpu-moe)" in result.stdout
    assert read_hz(node) == IDLE_HZ and not (root / "state.json").exists()


def test_check_needs_no_privilege_and_changes_nothing(jetson):
    root, node, config = jetson
    (node / "min_freq").chmod(0o444)  # as real sysfs looks to a user who may not write it
    before = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in node.iterdir() if p.is_file()}
    command = [
        sys.executable,
        "-m",
        "weightstream.cli",
        "clockfloor",
        "--check",
        "--config",
        str(config),
        "--sysfs-root",
        str(root / "sys"),
    ]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) not found: cannot drop root's capabilities for this check")
        # Root with every capability dropped: no DAC override, no BPF. (The interpreter lives under /root,
        # so switching to an unprivileged uid could not even start it.)
        command = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
    after = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in node.iterdir() if p.is_file()}
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "17000000.gpu (device 17000000.ga10b)  GPU" in out and "13d00000.host1x" in out
    assert "min 306 MHz, max 1020 MHz, cur 306 MHz, governor nvhost_podgov" in out
    assert "available MHz: 306 408 510 612 714 816 918 1020" in out
    assert "min_freq writable: no (the daemon must run as root)" in out
    assert "uprobe: unavailable:" in out and "announce: socket" in out and "poll: flags --cpu-moe" in out
    assert after == before and not (root / "state.json").exists()
