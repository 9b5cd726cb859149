"""Output directories that appear only when complete: built hidden beside the target, renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from weightstream.errors import WeightstreamError


def refuse_existing(out: str, force: bool) -> None:
    """An error for a non-empty `out` unless `force` (it is then replaced when the new one is complete)."""
    if os.path.exists(out) and os.listdir(out) and not force:
        raise WeightstreamError(f"{out}: exists and is not empty; choose another --out or pass --force to replace it")


@contextlib.contextmanager
def built_in_place(out: str, prefix: str) -> Iterator[str]:
    """Yields a hidden work directory beside `out`; renamed to `out` when the block ends, removed if it raises.

    A process killed inside the block leaves only the hidden `.<prefix>-*` directory, never `out`.
    """
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{prefix}-", dir=parent)
    try:
        yield tmp
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
