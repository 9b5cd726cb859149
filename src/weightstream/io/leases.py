"""Read leases on files a process holds mapped: told before another process writes or truncates one, not after.

A mapped file truncated under a running process kills it with SIGBUS at the next touch of a page past the new end;
a file rewritten in place hands it other bytes. Linux's file leases (fcntl F_SETLEASE, F_RDLCK) warn the holder:
an open of the file for writing, or a truncate, first sends the holder a signal and waits (up to
/proc/sys/fs/lease-break-time, 45 s by default) until the holder gives the lease up. The holder stops using its
mapping in that time (the engine's FileGuard: engine/file_guard.py), then gives it up, and the writer goes on. A
rename over the file or its deletion needs no notice: the mapping keeps the old file's bytes.

The notice is a real-time signal directed at one watcher thread (F_SETSIG, F_SETOWN_EX with the thread's id),
which keeps it blocked and waits for it with sigwaitinfo: no Python signal handler, no main-thread requirement, and
no other thread ever receives it. A lease is refused on a file this user does not own (without CAP_LEASE), on a
filesystem without leases, or on a file someone holds open for writing: such a file is left unguarded and said so
(`ReadLeases.unguarded`).
"""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import threading
import weakref
from collections.abc import Callable

NOTICE = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
F_SETOWN_EX, F_OWNER_TID = 15, 0  # <linux/fcntl.h>; Python's fcntl does not name them


class _Watcher:
    """One thread for every lease of the process: it blocks NOTICE, waits for it, and has each holder look."""

    _instance: _Watcher | None = None
    _create = threading.Lock()

    def __init__(self):
        self.holders: weakref.WeakSet[ReadLeases] = weakref.WeakSet()  # a holder nobody keeps closes itself
        self.lock = threading.Lock()
        ready = threading.Event()
        self.tid = 0

        def run() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {NOTICE})
            self.tid = threading.get_native_id()
            ready.set()
            while True:
                signal.sigwaitinfo({NOTICE})
                with self.lock:
                    holders = list(self.holders)
                for holder in holders:
                    holder.look()

        threading.Thread(target=run, name="weightstream-leases", daemon=True).start()
        ready.wait()

    @classmethod
    def get(cls) -> _Watcher:
        with cls._create:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance


class ReadLeases:
    """Read leases on `paths`; `on_notice(path)` runs (on the watcher thread) when another process is about to write
    or truncate one of them, before it may: every lease is given up when it returns, and never taken again."""

    def __init__(self, paths, on_notice: Callable[[str], None]):
        self.on_notice = on_notice
        self.fds: dict[int, str] = {}
        self.unguarded: dict[str, str] = {}  # path -> why no lease
        self._lock = threading.Lock()
        weakref.finalize(self, _release, self.fds)  # the descriptors of a holder dropped without close()
        if NOTICE is None or not hasattr(fcntl, "F_SETLEASE"):
            self.unguarded = {p: "this system has no file leases" for p in paths}
            return
        self.watcher = _Watcher.get()
        with self.watcher.lock:
            self.watcher.holders.add(self)
        for path in sorted(set(paths)):
            self._take(path)

    def _take(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.unguarded[path] = exc.strerror
            return
        try:
            fcntl.fcntl(fd, fcntl.F_SETSIG, NOTICE)
            fcntl.fcntl(fd, F_SETOWN_EX, struct.pack("ii", F_OWNER_TID, self.watcher.tid))
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            os.close(fd)
            self.unguarded[path] = exc.strerror
            return
        self.fds[fd] = path

    @property
    def guarded(self) -> list[str]:
        return sorted(self.fds.values())

    def look(self) -> None:
        """On a notice: the file whose lease is being broken (its lease now reads as the target, F_UNLCK) is told
        to `on_notice`, then every lease is given up."""
        with self._lock:
            broken = [path for fd, path in self.fds.items() if _lease(fd) != fcntl.F_RDLCK]
            if not broken:
                return
            try:
                self.on_notice(broken[0])
            finally:
                _release(self.fds)

    def close(self) -> None:
        with self._lock:
            _release(self.fds)
        if NOTICE is not None and hasattr(self, "watcher"):
            with self.watcher.lock:
                self.watcher.holders.discard(self)


def _release(fds: dict[int, str]) -> None:
    """Give up every lease of `fds` and close them (the writer waiting on one goes on)."""
    for fd in list(fds):
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        os.close(fd)
    fds.clear()


def _lease(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE)
    except OSError:
        return fcntl.F_UNLCK
