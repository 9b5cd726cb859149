"""Output directories that appear only when complete, and that `--force` may replace only when weightstream wrote them.

A directory is built hidden beside the target and renamed into place at the end, with an ownership record
(OWNER) listing what it holds. `--force` replaces an existing `--out` only when that record is there and lists
every entry in it: never a file, a symbolic link, the source being read, a directory that holds the source, or
a folder holding anything weightstream did not write. Refusals happen before any work, and again just before the
swap (the folder may have changed during a long run); the old directory is moved aside first and removed only
after the new one is in place.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from weightstream.errors import WeightstreamError

OWNER = ".weightstream-output.json"
# Directories written before OWNER existed: recognisable by weightstream's own manifest or the demo's marker, and
# then replaceable only if every entry is a file a checkpoint directory holds.
_LEGACY_MARKERS = ("weightstream-quantized.json", "weightstream-demo.json")
_CHECKPOINT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    *_LEGACY_MARKERS,
)


def refuse_existing(out: str, force: bool, sources: Iterable[str] = ()) -> None:
    """An error, before any work, when writing `out` could cost the user something.

    `sources` are the paths the command reads: `out` may be none of them nor hold any of them. An existing
    non-empty `out` needs `force`, and even then only a directory weightstream wrote (`replaceable`).
    """
    if os.path.islink(out):
        raise WeightstreamError(
            f"{out}: is a symbolic link; --out takes a directory path (give the directory it points to, "
            "or another --out)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise WeightstreamError(f"{out}: exists and is a file, not a directory; choose another --out")
    target = os.path.realpath(out)
    for src in sources:
        real = os.path.realpath(src)
        if real == target or real.startswith(target.rstrip(os.sep) + os.sep):
            what = "is" if real == target else "holds"
            raise WeightstreamError(
                f"--out {out} {what} the source {src}: writing there would delete it; choose another --out"
            )
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not force:
        raise WeightstreamError(f"{out}: exists and is not empty; choose another --out or pass --force to replace it")
    problem = _why_not_replaceable(out)
    if problem:
        raise WeightstreamError(
            f"{out}: --force replaces only a directory weightstream wrote, and {problem}; nothing was changed. "
            "Choose another --out, or move that directory away yourself"
        )


def read_owner(path: str) -> dict | None:
    """The ownership record of a directory weightstream wrote, or None."""
    try:
        with open(os.path.join(path, OWNER)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None


def _why_not_replaceable(out: str) -> str | None:
    entries = sorted(os.listdir(out))
    owner = read_owner(out)
    if owner is not None:
        extra = [e for e in entries if e != OWNER and e not in owner["files"]]
        return _listed("it holds what weightstream did not write", extra) if extra else None
    if not any(m in entries for m in _LEGACY_MARKERS):
        return f"it has no {OWNER} (weightstream did not write it)"
    extra = [e for e in entries if not any(fnmatch.fnmatch(e, p) for p in _CHECKPOINT_FILES)]
    if extra or any(os.path.isdir(os.path.join(out, e)) for e in entries):
        return _listed("it holds what weightstream did not write", extra or [e + "/" for e in entries])
    return None


def _listed(what: str, names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"{what}: {shown}"


@contextlib.contextmanager
def built_in_place(out: str, prefix: str, note: dict | None = None) -> Iterator[str]:
    """Yields a hidden work directory beside `out`; renamed to `out` when the block ends, removed if it raises.

    The ownership record (with `note`, if given) is written last. A process killed inside the block leaves only
    the hidden `.<prefix>-*` directory, never a changed `out`.
    """
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{prefix}-", dir=parent)
    try:
        yield tmp
        record = {"written_by": f"weightstream {prefix}", "files": sorted(os.listdir(tmp))}
        if note is not None:
            record["note"] = note
        with open(os.path.join(tmp, OWNER), "w") as f:
            json.dump(record, f, indent=1)
        _swap(tmp, out, parent, prefix)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(tmp: str, out: str, parent: str, prefix: str) -> None:
    """Put `tmp` at `out`; an existing `out` is checked again, moved aside, and removed once `tmp` is in place."""
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise WeightstreamError(f"{out}: became a file or a link while this ran; nothing was changed")
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    if os.listdir(out):
        problem = _why_not_replaceable(out)
        if problem:
            raise WeightstreamError(f"{out}: changed while this ran and {problem}; nothing was changed")
    aside = tempfile.mkdtemp(prefix=f".{prefix}-old-", dir=parent)
    os.rename(out, os.path.join(aside, "old"))
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(os.path.join(aside, "old"), out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
