"""Progress display on stderr for long work at any layer (silent when stderr is not a terminal): the commands
show it, and so does the conversion of a published checkpoint that a load starts (store/published.py)."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn


@contextlib.contextmanager
def byte_progress(label: str):
    """Yields update(done_bytes, total_bytes)."""
    console = Console(stderr=True)
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)
