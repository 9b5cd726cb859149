"""The kernel's proactive reclaim (DAMON): paused while something measures what the page cache holds.

Some machines (these VMs among them) run DAMON kdamonds with a `pageout` scheme: file pages idle for about a
second are evicted without memory pressure. A benchmark of the page-cache path, or a test counting cached pages,
would measure that policy instead of the one under test, so measured runs pause it (root only) and say so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

KDAMONDS = Path("/sys/kernel/mm/damon/admin/kdamonds")


def proactive_reclaim_state() -> str:
    """'on' when a kdamond runs, 'off' when none does, 'absent' without DAMON's admin interface."""
    states = [p.read_text().strip() for p in sorted(KDAMONDS.glob("*/state"))] if KDAMONDS.is_dir() else None
    if states is None:
        return "absent"
    return "on" if "on" in states else "off"


@contextlib.contextmanager
def paused_proactive_reclaim() -> Iterator[bool]:
    """Turn running kdamonds off for the block (root only); yields whether any was paused, and restores them."""
    paused = []
    for state in sorted(KDAMONDS.glob("*/state")) if os.geteuid() == 0 and KDAMONDS.is_dir() else []:
        try:
            if state.read_text().strip() == "on":
                state.write_text("off")
                paused.append(state)
        except OSError:
            pass
    try:
        yield bool(paused)
    finally:
        for state in paused:
            state.write_text("on")
