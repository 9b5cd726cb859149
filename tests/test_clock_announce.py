"""The engine's announcement channel: never raises, rate-limits itself, and the daemon counts it."""

import os
import socket
import subprocess
import sys

import pytest

from weightstream.clock.activity import AnnounceListener, Announcer, default_socket_path

from clockfakes import (
    SRC,
    DaemonProcess,
    make_devfreq_tree,
    read_hz,
    reap_children,  # noqa: F401  autouse fixture: ends every child a test started
    spawn,
    wait_for,
    write_config,
)

# An engine stand-in: a separate process that announces a decode step every 10 ms, carries no llama.cpp flag
# and barely uses CPU, so only the announcement can explain a raised floor.
ENGINE = """
import sys, time
from weightstream.clock.activity import Announcer
announce = Announcer.from_env()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    announce.decode_step()
    time.sleep(0.01)
print(announce.sent)
"""


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("kind", ["missing", "directory", "regular file", "unbound socket", "too long", "no dir"])
def test_decode_step_never_raises_when_nobody_listens(tmp_path, kind):
    path = {
        "missing": tmp_path / "absent.sock",
        "directory": tmp_path,
        "regular file": tmp_path / "file",
        "unbound socket": tmp_path / "dead.sock",
        "too long": tmp_path / ("x" * 200),
        "no dir": tmp_path / "nope" / "a.sock",
    }[kind]
    (tmp_path / "file").write_text("x")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()  # the file stays, nobody reads it: ECONNREFUSED
    clock = Clock()
    announcer = Announcer(str(path), clock=clock)
    for _ in range(1000):
        clock.now += 0.01
        announcer.decode_step()
    assert announcer.sent == 0
    # Backing off: 10 s of decode steps cost one send attempt per absent_retry_s, not 1000 syscalls.
    assert 9 <= announcer.attempts <= 11


def test_sends_at_most_one_datagram_per_interval(tmp_path):
    listener = AnnounceListener(str(tmp_path / "a.sock"))
    clock = Clock()
    announcer = Announcer(listener.path, interval_s=0.2, clock=clock)
    try:
        for _ in range(100):  # 100 steps over 1 s
            announcer.decode_step()
            clock.now += 0.01
        assert announcer.sent == 5
        assert listener.collect() == {os.getpid(): "announce"}
        assert listener.collect() == {}
    finally:
        announcer.close()
        listener.close()
    assert not os.path.exists(listener.path)


def test_from_env_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WEIGHTSTREAM_CLOCKFLOOR_SOCKET", str(tmp_path / "x.sock"))
    assert Announcer.from_env().path == str(tmp_path / "x.sock")
    monkeypatch.setenv("WEIGHTSTREAM_CLOCKFLOOR", "off")
    announcer = Announcer.from_env()
    announcer.decode_step()
    assert announcer.path is None and announcer.sent == 0
    monkeypatch.delenv("WEIGHTSTREAM_CLOCKFLOOR_SOCKET")
    monkeypatch.setenv("WEIGHTSTREAM_HOME", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "clockfloor" / "activity.sock")


def test_listener_sees_the_real_sender_pid_and_ignores_junk(tmp_path):
    listener = AnnounceListener(str(tmp_path / "a.sock"))
    try:
        junk = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        junk.sendto(b"hello", listener.path)
        env = dict(os.environ, PYTHONPATH=SRC, WEIGHTSTREAM_CLOCKFLOOR_SOCKET=listener.path)
        child = subprocess.run([sys.executable, "-c", ENGINE, "0.05"], env=env, capture_output=True, text=True)
        assert child.returncode == 0 and int(child.stdout) >= 1, child.stderr
        seen = listener.collect()
        assert len(seen) == 1 and next(iter(seen.values())) == "announce"
        assert next(iter(seen)) not in (os.getpid(), 0)  # the kernel's credentials, not ours
    finally:
        listener.close()


def test_daemon_raises_for_an_announcing_engine_without_flags(tmp_path):
    node = make_devfreq_tree(tmp_path / "sys")
    socket_path = tmp_path / "activity.sock"
    config = write_config(
        tmp_path / "c.conf", STATE_FILE=tmp_path / "state.json", SOCKET=socket_path, DETECT="announce poll", FLOOR=900
    )
    daemon = DaemonProcess("--config", str(config), "--sysfs-root", str(tmp_path / "sys"))
    daemon.wait_line("detecting by announce poll")
    env = dict(os.environ, PYTHONPATH=SRC, WEIGHTSTREAM_CLOCKFLOOR_SOCKET=str(socket_path))
    engine = spawn([sys.executable, "-c", ENGINE, "2.0"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: read_hz(node) == 918000000, 1.5) is not None, daemon.output()
        engine.wait(timeout=10)
        assert wait_for(lambda: read_hz(node) == 306000000, 2.0) is not None, daemon.output()
        daemon.wait_line(f"floor 918 MHz (pid {engine.pid} inference, announce)", timeout=5)
    finally:
        engine.kill()
        assert daemon.stop() == 0
    assert not socket_path.exists()
