"""A measurement in a process of its own: Python code run as `python -c`, whose last line of output is its result
as JSON. Each child pays its own imports and allocations, so builds and configurations timed one after another do
not share a process's warm state."""

from __future__ import annotations

import json
import subprocess
import sys


def json_child(code: str, failed: str, timeout: float | None = None) -> dict:
    """Run `code`, return the JSON object it printed last; a failure exits naming `failed` with the child's stderr."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{failed}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
