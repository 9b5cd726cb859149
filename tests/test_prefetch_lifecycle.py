"""Failures and kills: the command's outcome passes through and nothing is left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefetch_support import cli, drop, env_with_home, files, loader, make_checkpoint, tracefs_ok

pytestmark = [
    pytest.mark.skipif(not tracefs_ok(), reason="needs root and tracefs"),
    pytest.mark.usefixtures("no_proactive_reclaim"),
]
SPEC = ["--spec", "model=life"]
HARNESS = str(Path(__file__).with_name("prefetch_harness.py"))


@pytest.fixture()
def recorded(tmp_path):
    ckpt = make_checkpoint(tmp_path / "model")
    home = tmp_path / "home"
    rec = cli(home, "prefetch", "record", *SPEC, "--model-dir", str(ckpt), "--", *loader("read", files(ckpt)))
    assert rec.returncode == 0, rec.stderr.decode()
    return home, files(ckpt)


def _harness(home: Path, *command: str) -> dict:
    out = subprocess.run(
        [sys.executable, HARNESS, "model=life", "--", *command],
        env=env_with_home(home),
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout.decode().splitlines()[-1])


def test_failing_command_leaves_no_thread_child_or_instance(recorded):
    home, paths = recorded
    drop(paths)
    left = _harness(home, *loader("read", paths, "--exit", "4", "--sleep-per-mib", "0.01"))
    assert left["rc"] == 4 and left["template_used"] and left["prefetched"] > 0
    assert left["threads"] == ["MainThread"] and left["tasks"] == 1, left
    assert left["children"] == [] and left["instances"] == []


def test_command_killed_by_signal_passes_the_signal_through(recorded):
    home, paths = recorded
    prog = "import os, signal; print('bye', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    out = cli(home, "prefetch", "run", *SPEC, "--", sys.executable, "-c", prog)
    assert out.returncode == -signal.SIGKILL and out.stdout == b"bye\n"
    assert b"exit -9" in out.stderr  # the report was printed before dying the same way
    left = _harness(home, sys.executable, "-c", prog)
    assert left["rc"] == -signal.SIGKILL and left["threads"] == ["MainThread"] and left["children"] == []


def _start_sleeper(home: Path) -> tuple[subprocess.Popen, int]:
    prog = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "weightstream.cli", "prefetch", "run", *SPEC, "--", sys.executable, "-c", prog],
        env=env_with_home(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return wrapper, int(wrapper.stdout.readline())


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return True
        if state == "Z":  # exited, waiting for its (dead) parent's reaper
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_wrapper_reaches_the_command(recorded):
    home, _ = recorded
    wrapper, child = _start_sleeper(home)
    time.sleep(0.3)
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=30) == -signal.SIGTERM
    assert _gone(child)
    assert b"exit -15" in wrapper.stderr.read()


def test_sigkill_to_wrapper_takes_the_command_and_stale_instance_is_cleaned(recorded):
    home, paths = recorded
    wrapper, child = _start_sleeper(home)
    stale = list(Path("/sys/kernel/tracing/instances").glob(f"weightstream-{wrapper.pid}-*"))
    assert stale, "tracing was attached while the command runs"
    wrapper.kill()
    wrapper.wait(timeout=30)
    assert _gone(child)
    assert stale[0].exists()  # nobody could clean up after SIGKILL ...
    drop(paths)
    out = cli(home, "prefetch", "run", *SPEC, "--", *loader("read", paths))
    assert out.returncode == 0
    assert not stale[0].exists()  # ... so the next session does
