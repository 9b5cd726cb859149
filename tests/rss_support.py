"""Peak RSS of a piece of work in a child process, measured the one way the memory-bound tests agree on."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def peak_over_baseline(code: str, *args: str, timeout: float = 600) -> tuple[int, int]:
    """Run `code` (which prints json.dumps([baseline peak RSS, final peak RSS])) with `args` as sys.argv[1:]; its
    two figures. glibc maps every buffer over 128 KiB on its own, so the figure is the work's working set and not
    the heap's fragmentation (tests/test_quantize.py::test_peak_rss_is_bounded_... says why)."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    )
    assert run.returncode == 0, run.stderr
    base, peak = json.loads(run.stdout)
    return base, peak
