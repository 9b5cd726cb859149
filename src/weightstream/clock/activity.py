"""The engine's decode announcements: a client that costs ~nothing, and the daemon's listener.

The engine calls ``Announcer.from_env().decode_step()`` once per decoded token. At most one datagram per
``interval_s`` leaves the process (a non-blocking ``sendto`` on a unix datagram socket); when no daemon listens
the send fails and is ignored, and the next try waits ``absent_retry_s``. Nothing here ever raises into the
engine. Standard library only, so the engine can import it without weightstream's heavy dependencies.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

MESSAGE = b"weightstream decode"
SOCKET_ENV = "WEIGHTSTREAM_CLOCKFLOOR_SOCKET"
DISABLE_ENV = "WEIGHTSTREAM_CLOCKFLOOR"  # "off" turns announcing into a no-op
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def default_socket_path() -> str:
    """$WEIGHTSTREAM_CLOCKFLOOR_SOCKET, else $WEIGHTSTREAM_HOME/clockfloor/activity.sock, else under /run."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    home = os.environ.get("WEIGHTSTREAM_HOME")
    if home:
        return os.path.join(home, "clockfloor", "activity.sock")
    return "/run/weightstream-clockfloor/activity.sock"


class Announcer:
    """Engine side: say "a decode step ran" to a clockfloor daemon if one listens."""

    def __init__(self, path: str | None, interval_s: float = 0.2, absent_retry_s: float = 1.0, clock=time.monotonic):
        self.path = path
        self.interval_s = interval_s
        self.absent_retry_s = absent_retry_s
        self.sent = 0
        self.attempts = 0
        self._clock = clock
        self._next_send = 0.0
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls) -> Announcer:
        """An announcer for the socket the daemon uses; a no-op one when WEIGHTSTREAM_CLOCKFLOOR=off."""
        try:
            if os.environ.get(DISABLE_ENV, "").lower() in ("off", "0", "no"):
                return cls(None)
            return cls(default_socket_path())
        except Exception:  # never break the engine over a clock hint
            return cls(None)

    def decode_step(self) -> None:
        """Call once per decoded token; sends at most one datagram per interval and never raises."""
        try:
            now = self._clock()
            if self.path is None or now < self._next_send:
                return
            self._next_send = now + self.interval_s
            self.attempts += 1
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(MESSAGE, self.path)
            self.sent += 1
        except Exception:
            # No daemon (ENOENT, ECONNREFUSED), its queue full (EAGAIN), a bad path: back off and stay quiet.
            self._next_send = self._clock() + self.absent_retry_s

    def close(self) -> None:
        """Release the socket; later decode_step calls reopen it."""
        try:
            if self._sock is not None:
                self._sock.close()
        except Exception:
            pass
        self._sock = None


class AnnounceListener:
    """Daemon side: a unix datagram socket that reports which pids announced decode steps (kernel-verified)."""

    name = "announce"

    def __init__(self, path: str):
        self.path = path
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self._remove_stale_socket()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # SO_PASSCRED makes the kernel attach the sender's real pid to each datagram; it cannot be forged.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(path)
        os.chmod(path, 0o666)  # engines run as ordinary users; the daemon runs as root
        self._sock.setblocking(False)
        self._inode = os.stat(path).st_ino

    def _remove_stale_socket(self) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fileno(self) -> int:
        """For select()."""
        return self._sock.fileno()

    def collect(self, now: float | None = None) -> dict[int, str]:
        """Drain pending datagrams; returns {pid: 'announce'} for each sender seen."""
        active: dict[int, str] = {}
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(256, socket.CMSG_SPACE(UCRED.size))
            except (BlockingIOError, InterruptedError):
                return active
            pid = _sender_pid(ancillary)
            if data.startswith(MESSAGE) and pid > 0:
                active[pid] = "announce"

    def close(self) -> None:
        """Close and remove the socket file if it is still ours."""
        self._sock.close()
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _sender_pid(ancillary) -> int:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
            return UCRED.unpack_from(payload)[0]
    return -1
