"""The state file: written before the floor goes up, removed after it comes down.

A daemon killed with the floor raised (SIGKILL, OOM, power cut of the daemon only) leaves the file behind;
the next start reads it and puts the original value back. A lock beside it keeps two daemons from fighting.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from weightstream.errors import WeightstreamError


class StateFile:
    """JSON record of a raised floor, plus an exclusive lock held for the daemon's lifetime."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        """Take the daemon lock or say who holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            message = f"cannot create {self.lock_path} ({exc.strerror}); set STATE_FILE or run as root"
            raise WeightstreamError(message) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            message = f"another clockfloor daemon (pid {holder}) holds {self.lock_path}; stop it first"
            raise WeightstreamError(message) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        """Drop the lock (the lock file itself stays; removing it would race a starting daemon)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def read(self) -> dict | None:
        """The recorded snapshot, None when there is none or it is unreadable."""
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"unreadable": True}
        return record if isinstance(record, dict) else {"unreadable": True}

    def write(self, snapshot: dict) -> None:
        """Record the snapshot atomically (a reader never sees half a file)."""
        record = dict(snapshot, pid=os.getpid())
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(record, sort_keys=True) + "\n")
        os.replace(temporary, self.path)

    def clear(self) -> None:
        """Forget the snapshot."""
        self.path.unlink(missing_ok=True)
