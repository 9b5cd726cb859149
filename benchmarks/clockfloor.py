"""clockfloor costs and reaction times, as JSON.

- announce: ns per Announcer.decode_step() with no daemon and with one listening, vs an empty method call.
- poll_scan: µs per ProcessPoller poll vs a naive poller that re-reads every process's argv each time.
- daemon_idle_cpu: the daemon's own CPU use over a quiet window (all detectors on).
- reaction: seconds from a flagged process starting to the floor rising, and from its exit to the floor
  falling (hold 1.0 s), per detection method, on a fake Jetson devfreq tree with real processes.

Run: .venv/bin/python benchmarks/clockfloor.py [--rounds N] [--out FILE]   (prints JSON, writes it to --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.results import default, save

from weightstream.clock.activity import AnnounceListener, Announcer
from weightstream.clock.fakes import (
    DaemonProcess,
    burner,
    make_devfreq_tree,
    read_hz,
    reap_spawned,
    spawn,
    wait_for,
    write_config,
)
from weightstream.clock.procscan import YOUNG_S, FlagMatcher, ProcessPoller, read_argv
from weightstream.clock.uprobe import unavailable_reason

FLAGS = ("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe")


class Empty:
    """The baseline: a method call that does nothing."""

    def decode_step(self) -> None:
        """Nothing."""


def ns_per_call(target, calls: int = 200_000) -> float:
    """Mean ns per target.decode_step()."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        target.decode_step()
    return (time.perf_counter_ns() - start) / calls


def announce_cost(directory: Path) -> dict:
    """decode_step cost with nobody listening and with a listener, against the empty call."""
    absent = Announcer(str(directory / "nobody.sock"))
    listener = AnnounceListener(str(directory / "listening.sock"))
    listening = Announcer(listener.path)
    result = {
        "noop_call_ns": ns_per_call(Empty()),
        "decode_step_no_daemon_ns": ns_per_call(absent),
        "decode_step_daemon_listening_ns": ns_per_call(listening),
    }
    listener.close()
    result["ratio_no_daemon"] = result["decode_step_no_daemon_ns"] / result["noop_call_ns"]
    result["ratio_listening"] = result["decode_step_daemon_listening_ns"] / result["noop_call_ns"]
    return result


def naive_poll(matcher: FlagMatcher) -> int:
    """The baseline poller: read every process's argv on every poll."""
    return sum(1 for name in os.listdir("/proc") if name.isdigit() and matcher.match(read_argv(int(name)) or []))


def poll_cost(polls: int = 200) -> dict:
    """µs per steady-state ProcessPoller poll against the naive scan."""
    matcher = FlagMatcher(FLAGS)
    poller = ProcessPoller(matcher, 0.25, poll_s=0.0)
    poller.collect(time.monotonic())  # first sight of every pid: argv read
    time.sleep(YOUNG_S + 0.1)  # steady state: pids past their young (re-read every poll) period
    poller.collect(time.monotonic())
    start = time.perf_counter()
    for _ in range(polls):
        poller.collect(time.monotonic())
    ours = (time.perf_counter() - start) / polls * 1e6
    start = time.perf_counter()
    for _ in range(polls):
        naive_poll(matcher)
    naive = (time.perf_counter() - start) / polls * 1e6
    processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
    return {
        "processes": processes,
        "poller_us_per_poll": ours,
        "naive_full_scan_us_per_poll": naive,
        "ratio": ours / naive,
    }


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_daemon(directory: Path, detect: str, **keys) -> tuple[DaemonProcess, Path]:
    """The CLI daemon on a fresh fake Jetson tree, ready."""
    node = make_devfreq_tree(directory / "sys")
    config = write_config(
        directory / "c.conf",
        STATE_FILE=directory / "state.json",
        SOCKET=directory / "a.sock",
        DETECT=detect,
        HOLD=1.0,
        **keys,
    )
    daemon = DaemonProcess("--config", str(config), "--sysfs-root", str(directory / "sys"))
    daemon.wait_line("detecting by")
    return daemon, node


def idle_cpu(directory: Path, seconds: float) -> dict:
    """The daemon's CPU use with nothing to detect."""
    daemon, _ = start_daemon(directory, "uprobe announce poll")
    before, start = cpu_seconds(daemon.process.pid), time.monotonic()
    time.sleep(seconds)
    used = cpu_seconds(daemon.process.pid) - before
    daemon.stop()
    return {"seconds": seconds, "cpu_fraction_of_one_core": used / (time.monotonic() - start)}


ENGINE = """
import sys, time
from weightstream.clock.activity import Announcer
announce, end = Announcer.from_env(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    announce.decode_step()
    time.sleep(0.01)
"""


def build_uprobe_lab(directory: Path) -> Path:
    """The test libllama.so and decode loop, built with gcc."""
    sources = Path(__file__).resolve().parents[1] / "tests" / "clock_uprobe"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", f"{directory}/libllama.so", f"{sources}/libllama.c"], check=True
    )
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-o",
            f"{directory}/decode_loop",
            f"{sources}/decode_loop.c",
            f"-L{directory}",
            "-lllama",
            f"-Wl,-rpath,{directory}",
        ],
        check=True,
    )
    return directory / "libllama.so"


def one_reaction(daemon: DaemonProcess, node: Path, start_child, stop_child) -> tuple[float, float]:
    """Seconds to raise after the child starts, and to restore after it is killed."""
    idle = read_hz(node)
    child = start_child()
    raised = wait_for(lambda: read_hz(node) != idle, 10.0)
    stop_child(child)
    exited = time.monotonic()
    wait_for(lambda: read_hz(node) == idle, 10.0)
    return raised, time.monotonic() - exited if raised is not None else float("nan")


def reaction(directory: Path, method: str, rounds: int) -> dict:
    """Reaction times of one detection method, over rounds."""
    env = dict(os.environ, WEIGHTSTREAM_CLOCKFLOOR_SOCKET=str(directory / "a.sock"))
    keys, start_child = {}, None
    if method == "poll":
        start_child = lambda: burner(30, "--cpu-moe")  # noqa: E731
    elif method == "announce":
        start_child = lambda: spawn([sys.executable, "-c", ENGINE, "30"], env=env)  # noqa: E731
    else:
        keys["LIBRARIES"] = build_uprobe_lab(directory)
        start_child = lambda: spawn([str(directory / "decode_loop"), "0", "20000", "--cpu-moe"])  # noqa: E731

    def stop_child(child):
        """Let it run half a second, then kill it."""
        time.sleep(0.5)
        child.kill()
        child.wait()

    daemon, node = start_daemon(directory, method, **keys)
    if method == "uprobe":
        daemon.wait_line("uprobes: attached")
    samples = [one_reaction(daemon, node, start_child, stop_child) for _ in range(rounds)]
    daemon.stop()
    raise_s, restore_s = [s[0] for s in samples], [s[1] for s in samples]
    return {
        "raise_s_median": statistics.median(raise_s),
        "raise_s_max": max(raise_s),
        "restore_after_exit_s_median": statistics.median(restore_s),
        "hold_s": 1.0,
        "rounds": rounds,
    }


def main() -> None:
    """Run every measurement and print JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--out", default=default("clockfloor.json"), help="result file (default: %(default)s)")
    args = parser.parse_args()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    results = {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory() as directory:
        results["announce"] = announce_cost(Path(directory))
    results["poll_scan"] = poll_cost()
    with tempfile.TemporaryDirectory() as directory:
        results["daemon_idle_cpu"] = idle_cpu(Path(directory), args.idle_seconds)
    results["reaction"] = {}
    try:
        for method in ("poll", "announce", "uprobe"):
            reason = unavailable_reason() if method == "uprobe" else None
            with tempfile.TemporaryDirectory() as directory:
                results["reaction"][method] = (
                    {"skipped": reason} if reason else reaction(Path(directory), method, args.rounds)
                )
    finally:
        reap_spawned()  # a daemon or child a failed round left running
    text = json.dumps(results, indent=2)
    print(text)
    save(text, args.out)


if __name__ == "__main__":
    main()
