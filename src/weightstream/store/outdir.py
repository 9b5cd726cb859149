"""Output directories that appear only when complete, and that `--force` may replace only when weightstream wrote them.

A directory is built hidden beside the target and renamed into place at the end, with an ownership record
(OWNER) listing what it holds. `--force` replaces an existing `--out` only when that record is there and lists
every entry in it: never a file, a symbolic link, the source being read, a directory that holds the source, or
a folder holding anything weightstream did not write. Refusals happen before any work, and again just before the
swap (the folder may have changed during a long run); the old directory is moved aside first and removed only
after the new one is in place.

A run holds a lock on its hidden directories while it lives: one whose run was killed (SIGKILL, a power cut) holds
none, and the next run into the same folder removes it, saying so. A disk that cannot hold the output is an error
naming the folder, its free space and about what the output needs: before any work where the caller knows the size,
and when a write fails for want of space (nothing is left behind).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator

from weightstream.errors import WeightstreamError
from weightstream.units import format_bytes

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
def built_in_place(out: str, prefix: str, note: dict | None = None, needed: int | None = None) -> Iterator[str]:
    """Yields a hidden work directory beside `out`; renamed to `out` when the block ends, removed if it raises.

    The ownership record (with `note`, if given) is written last. A process killed inside the block leaves only
    the hidden `.<prefix>-*` directory, never a changed `out`; the next run removes it (`_remove_stale`). `needed`
    (bytes, about what `out` will take) is refused before any work when the disk has less free, and said when a
    write fails for want of space.
    """
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent, prefix)
    free = _free_bytes(parent)
    if needed is not None and free is not None and free < needed:
        raise WeightstreamError(
            f"{out}: not enough space on {parent} ({_space(free, needed)}); "
            "nothing was written: free some space there or choose another --out"
        )
    try:
        tmp, lock = _locked_dir(f".{prefix}-", parent)
    except OSError as exc:
        if _out_of_space(exc):
            raise _no_space(out, parent, needed) from exc
        raise
    try:
        yield tmp
        record = {"written_by": f"weightstream {prefix}", "files": sorted(os.listdir(tmp))}
        if note is not None:
            record["note"] = note
        with open(os.path.join(tmp, OWNER), "w") as f:
            json.dump(record, f, indent=1)
        _swap(tmp, out, parent, prefix)
    except BaseException as exc:
        written = _size(tmp) if _out_of_space(exc) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(exc):
            raise _no_space(out, parent, max(needed or 0, written)) from exc
        raise
    finally:
        os.close(lock)


def _no_space(out: str, parent: str, needed: int | None) -> WeightstreamError:
    """The error of a write into `parent` that failed for want of space (its free space read after the cleanup);
    `needed`: the caller's estimate, or what was written when the space ran out where that is more."""
    free = _free_bytes(parent)
    return WeightstreamError(
        f"{out}: no space left on {parent} while writing it ({_space(free, needed)}); the partial output is removed: "
        "free some space there or choose another --out"
    )


# mkdtemp's names: the prefix, then 8 of [a-z0-9_]
_WORK_NAME = r"\.{prefix}(-old)?-[a-z0-9_]{{8}}"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _space(free: int | None, needed: int | None) -> str:
    """'1.2 MiB free, about 3.4 MiB needed', in KiB where the two would read alike."""
    text = format_bytes
    if free is not None and needed and format_bytes(free) == format_bytes(needed):
        text = lambda n: f"{n / 1024:,.0f} KiB"
    said = f"{text(free)} free" if free is not None else "free space unknown"
    return said + (f", about {text(needed)} needed" if needed else "")


def _out_of_space(exc: BaseException) -> bool:
    """Whether `exc` is, or was raised while handling, a write that failed for want of space."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still write on the filesystem holding `path`; None where it does not say."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def _locked_dir(prefix: str, parent: str) -> tuple[str, int]:
    """A new directory `parent/<prefix>XXXXXXXX` and a descriptor holding an exclusive lock on it, so that no other
    run takes it for a dead run's (`_remove_stale`). Where the filesystem has no such locks the directory is
    unlocked, and `_remove_stale` leaves it alone."""
    while True:
        path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run found it unlocked and is removing it: take another
            os.close(fd)
            continue
        except OSError:
            return path, fd
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return path, fd
        except FileNotFoundError:  # removed by another run between mkdtemp and the lock
            pass
        os.close(fd)


def _remove_stale(parent: str, prefix: str) -> None:
    """Removes, saying so, the hidden `.<prefix>-*` directories in `parent` whose run is gone (no lock held: killed
    before it could clean up). A live run's directory is locked and left alone, as is anything not named as this
    module names them."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    pattern = re.compile(_WORK_NAME.format(prefix=re.escape(prefix)))
    for name in sorted(names):
        path = os.path.join(parent, name)
        if not pattern.fullmatch(name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                continue
            size = _size(path)
            shutil.rmtree(path)
        except OSError:  # locked by a live run, or not ours to remove: left as it is
            continue
        finally:
            os.close(fd)
        print(
            f"weightstream {prefix}: removed {path} ({format_bytes(size)}), left by an earlier run that did not finish",
            file=sys.stderr,
        )


def _size(path: str) -> int:
    """Bytes of the files under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


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
    aside, lock = _locked_dir(f".{prefix}-old-", parent)
    try:
        os.rename(out, os.path.join(aside, "old"))
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(os.path.join(aside, "old"), out)
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(aside)  # empty unless the old directory could not be put back: then it is there
        raise
    else:
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        os.close(lock)
