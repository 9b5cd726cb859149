"""Polling detection on real processes: flags in argv, CPU in use, argv changed by exec."""

import sys
import time

import pytest

from weightstream.clock.procscan import FlagMatcher, ProcessPoller, read_argv, read_cpu_ticks

from clockfakes import (
    BURN,
    burner,
    reap_children,  # noqa: F401  autouse fixture: ends every child a test started
    sleeper,
    spawn,
    wait_for,
)

MATCHER = FlagMatcher(("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe"))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["llama-server", "-m", "x.gguf", "--cpu-moe"], "--cpu-moe"),
        (["llama-cli", "-ncmoe", "20"], "-ncmoe"),
        (["llama-cli", "--n-cpu-moe=20"], "--n-cpu-moe"),
        (["llama-cli", "--cpu-moes"], None),
        (["llama-cli", "-cmoe-x"], None),
        (["--cpu-moe"], None),  # argv[0] is the program, not a flag
        (["llama-cli", "-p", "explain --cpu-moe please"], None),
    ],
)
def test_flag_matching_is_by_whole_argument(argv, flag):
    assert MATCHER.match(argv) == flag


def test_argv_and_cpu_ticks_of_a_real_process():
    child = burner(1.0, "--cpu-moe", "a b")
    try:
        assert wait_for(lambda: (read_argv(child.pid) or [])[-2:] == ["--cpu-moe", "a b"], 2) is not None
        first = read_cpu_ticks(child.pid)
        time.sleep(0.3)
        assert read_cpu_ticks(child.pid) > first
    finally:
        child.wait()
    assert read_argv(child.pid) is None and read_cpu_ticks(child.pid) is None


def poll_until(poller, predicate, timeout):
    """Poll with the real clock until predicate(active) holds; returns the last answer."""
    deadline = time.monotonic() + timeout
    active = {}
    while time.monotonic() < deadline:
        active = poller.collect(time.monotonic())
        if predicate(active):
            return active
        time.sleep(0.02)
    return active


def test_poller_reports_busy_flagged_processes_only():
    poller = ProcessPoller(MATCHER, cpu_threshold=0.25, poll_s=0.1)
    busy, idle, other = burner(3, "--cpu-moe"), sleeper(3, "--cpu-moe"), burner(3, "--x")
    try:
        time.sleep(0.3)  # let the sleeper's interpreter start-up pass
        active = poll_until(poller, lambda a: busy.pid in a, 1.5)
        assert active.get(busy.pid) == "poll --cpu-moe"
        assert poller.cores[busy.pid] >= 0.25 and poller.cores[idle.pid] < 0.05
        assert idle.pid not in active and other.pid not in active and other.pid not in poller.cores
        assert idle.poll() is None and other.poll() is None
    finally:
        for process in (busy, idle, other):
            process.kill()
            process.wait()
    assert poll_until(poller, lambda a: busy.pid not in a, 1.0).get(busy.pid) is None


def test_a_process_that_execs_into_a_flagged_program_is_caught():
    # Fork-then-exec: the first argv the poller sees is the parent's; young processes are re-read.
    exec_later = (
        "import os, sys, time; time.sleep(0.4); "
        f"os.execv(sys.executable, [sys.executable, '-c', {BURN!r}, '3', '--cpu-moe'])"
    )
    poller = ProcessPoller(MATCHER, cpu_threshold=0.25, poll_s=0.1)
    child = spawn([sys.executable, "-c", exec_later])
    try:
        assert poll_until(poller, lambda a: True, 0.3) == {} and poller.seen[child.pid].flag is None
        assert poll_until(poller, lambda a: child.pid in a, 2.0).get(child.pid) == "poll --cpu-moe"
    finally:
        child.kill()
        child.wait()
