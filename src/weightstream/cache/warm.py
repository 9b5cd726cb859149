"""Warm restart: which experts the expert cache held and how hot they were, saved beside the model and read back.

The state is `MODEL/.weightstream/expert-cache-state.json`: the experts resident at the save, hottest first, with
their lookup counts, and a fingerprint of the expert files (names, sizes, modification times, slot size) so a state
is never applied to other bytes. It is written at exit and at intervals (`StateSaver`), atomically (a temporary
file renamed over the old one), so a crash leaves the previous state whole; the next save removes the temporary file
a killed one left. At start the engine queues the saved experts into free slots in order of heat at read-ahead
priority (`ExpertCache.warm`): the first requests then find them resident, and a demand read is never queued behind
them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time

from weightstream.cache.expert_cache import ExpertCache
from weightstream.cache.policy import Key
from weightstream.store.layout import ModelLayout

STATE_FILE = "expert-cache-state.json"
VERSION = 1


def state_path(model_dir: str) -> str:
    return os.path.join(model_dir, ".weightstream", STATE_FILE)


def fingerprint(layout: ModelLayout) -> str:
    """Names, sizes and modification times of the expert files, and the slot size: what the saved keys mean."""
    files = sorted({p.path for e in layout.experts.values() for p in e.pieces})
    h = hashlib.sha256(f"{layout.slot_bytes}:{len(layout.experts)}".encode())
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:32]


def save_state(cache: ExpertCache, path: str) -> bool:
    """Writes the cache's resident experts by heat to `path`; False (and why, once on stderr) if it cannot."""
    state = {
        "version": VERSION,
        "fingerprint": fingerprint(cache.layout),
        "saved_at": time.time(),
        "experts": [[layer, expert, heat] for (layer, expert), heat in cache.resident_by_heat()],
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _remove_stale(path)
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
        return True
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        then = "reads the state saved before" if os.path.exists(path) else "is cold"
        _say_once(f"cannot save the expert cache's state to {path} ({e.strerror}); the next start {then}")
        return False


def _remove_stale(path: str) -> None:
    """Removes the temporary files of saves to `path` whose process is gone (killed between writing and renaming)."""
    folder, name = os.path.split(path)
    for entry in os.listdir(folder):
        pid = entry[len(name) + 1 : -len(".tmp")]
        if entry.startswith(f"{name}.") and entry.endswith(".tmp") and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        pass
    return True


def read_state(path: str, layout: ModelLayout) -> tuple[list[Key], dict[Key, int]] | None:
    """(keys hottest first, their heat) saved at `path` for these expert files; None when there is none, it is
    unreadable or it was saved for other files (each said on stderr, none an error: the start is then cold)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        if not isinstance(state, dict):  # valid JSON of another shape: `[]`, `null`, a number
            raise ValueError(f"it holds {json.dumps(state)[:40]}, not a JSON object")
        if state.get("version") != VERSION or state.get("fingerprint") != fingerprint(layout):
            _say_once(f"{path} was saved for other expert files; starting cold")
            return None
        keys = [(int(layer), int(expert)) for layer, expert, _ in state["experts"]]
        heat = {(int(layer), int(expert)): int(n) for layer, expert, n in state["experts"]}
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:  # Infinity; deep nesting
        _say_once(f"{path} is unreadable ({e}); starting cold")
        return None
    return keys, heat


class StateSaver:
    """Saves a cache's state at most every `interval_s` seconds when `tick` is called, and at `close`."""

    def __init__(self, cache: ExpertCache, path: str, interval_s: float = 60.0):
        self.cache, self.path, self.interval_s = cache, path, interval_s
        self._last = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            save_state(self.cache, self.path)

    def close(self) -> None:
        save_state(self.cache, self.path)


_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        print(f"weightstream: {msg}", file=sys.stderr)
