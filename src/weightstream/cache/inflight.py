"""Read-aheads whose bytes are still landing, shared between the compute thread and the I/O threads."""

from __future__ import annotations

import queue
import threading
import time

from weightstream.cache.policy import Key


class InFlightReadAheads:
    """A demand lookup that finds one listens for its arrival; an eviction that picks one waits for it to land.

    Without this a lookup could compute from a half-filled slot, or a demand read could be overwritten by a
    late read-ahead into the same slot.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._listener: dict[Key, queue.SimpleQueue | None] = {}  # key -> where its arrival is announced

    def __contains__(self, key: Key) -> bool:
        with self._cond:
            return key in self._listener

    def __len__(self) -> int:
        with self._cond:
            return len(self._listener)

    def start(self, key: Key) -> None:
        """Called before the reads are queued, so a read that lands at once still finds its entry."""
        with self._cond:
            assert key not in self._listener, key
            self._listener[key] = None

    def landed(self, key: Key, error: BaseException | None) -> None:
        """I/O thread: all of `key`'s bytes are in its slot (or the read failed); tell whoever listens."""
        with self._cond:
            listener = self._listener.pop(key)
            self._cond.notify_all()
        if listener is not None:
            listener.put((key[1], error))

    def listen(self, key: Key, arrived: queue.SimpleQueue) -> bool:
        """Announce `key`'s arrival on `arrived` exactly once; False when it has landed already (use it now)."""
        with self._cond:
            if key not in self._listener:
                return False
            assert self._listener[key] is None, f"{key} is already awaited by another lookup"
            self._listener[key] = arrived
            return True

    def wait_landed(self, key: Key) -> float:
        """Block until `key`'s reads are done; returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while key in self._listener:
                self._cond.wait()
        return time.perf_counter() - start
