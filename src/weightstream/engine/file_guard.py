"""A loaded model's weight files guarded: a file opened for writing or truncated under the running model becomes an
error naming it, never a SIGBUS and never other bytes (issue 52, case 1).

Dense weights stay in safetensors' mappings (copying them would take memory the budget gives the expert cache, and
mapped clean pages are what the kernel reclaims under a memory limit); experts are O_DIRECT reads, where a
truncated file is a short read, already an error. Every weight file holds a read lease (io/leases.py). Every
forward runs under the guard's lock; when another process is about to write or truncate a file, the notice waits
for the forward in flight to end, marks the model broken and gives the leases up: the writer goes on, and each
later forward raises the error (`generate` exits with it; `serve` answers its requests with it, a 500, and keeps
its HTTP up). A file renamed over or deleted needs nothing: the mappings and the open descriptors keep the bytes
that were loaded.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

from weightstream.errors import WeightstreamError
from weightstream.io.leases import ReadLeases


class FileGuard:
    def __init__(self, paths):
        self.lock = threading.RLock()
        self.broken: str | None = None
        self.leases = ReadLeases(paths, self._notice)

    def _notice(self, path: str) -> None:
        with self.lock:  # the forward in flight ends first: it may be reading the file's pages
            self.broken = (
                f"{path} was opened for writing or truncated while the model ran from it: its weights can no "
                "longer be read safely; restore the checkpoint and load the model again"
            )
        print(f"weightstream: {self.broken}", file=sys.stderr, flush=True)

    def check(self) -> None:
        if self.broken is not None:
            raise WeightstreamError(self.broken)

    def report(self) -> dict:
        """For `--json` stats: how many weight files are guarded, and why any is not."""
        return {"guarded_files": len(self.leases.guarded), "unguarded": dict(self.leases.unguarded)}

    def close(self) -> None:
        self.leases.close()


def guard_model(model: torch.nn.Module, paths) -> FileGuard:
    """Leases on `paths` (the model's weight files), and `model.forward` run under the guard."""
    guard = FileGuard(paths)
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with guard.lock:
            guard.check()
            return inner(*args, **kwargs)

    model.forward = forward
    return guard
