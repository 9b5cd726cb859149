"""Load templates: per worker process, the ordered (file, offset, length) ranges a loader read from disk."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass, field

from weightstream.units import PAGE

FORMAT = "weightstream-load-template"
VERSION = 1
_SAMPLES = 8  # evenly spaced 4 KiB samples in the fingerprint, besides the head and the tail
_HEAD = 64 << 10


class TemplateError(Exception):
    """A template that cannot be used; the message is the one-line reason shown to the user."""


def fingerprint(path: str, size: int) -> str:
    """A content fingerprint: hash of the size, the first 64 KiB, 8 spread 4 KiB samples and the last 4 KiB.

    Sampled, not a full hash, so that checking a 100 GiB checkpoint costs a few small reads.
    """
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        digest.update(os.pread(fd, _HEAD, 0))
        for i in range(1, _SAMPLES + 1):
            digest.update(os.pread(fd, PAGE, size * i // (_SAMPLES + 1)))
        digest.update(os.pread(fd, PAGE, max(0, size - PAGE)))
    finally:
        os.close(fd)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """Who a model file is: path, size, mtime, device, inode and a content fingerprint."""

    path: str
    size: int
    mtime_ns: int
    dev: int
    inode: int
    fingerprint: str

    @classmethod
    def of(cls, path: str) -> FileIdentity:
        """Identify the file at path now."""
        path = os.path.realpath(path)
        st = os.stat(path)
        return cls(path, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, fingerprint(path, st.st_size))

    def mismatch(self) -> str | None:
        """Why the file on disk is no longer this one, or None when it still is."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            return f"model file {self.path} is gone ({exc.strerror})"
        for name, now, then in (
            ("size", st.st_size, self.size),
            ("mtime", st.st_mtime_ns, self.mtime_ns),
            ("inode", st.st_ino, self.inode),
            ("device", st.st_dev, self.dev),
        ):
            if now != then:
                return f"model file {self.path} changed since recording ({name} {then} -> {now})"
        if fingerprint(self.path, st.st_size) != self.fingerprint:
            return f"model file {self.path} changed since recording (content fingerprint differs)"
        return None


@dataclass(slots=True)
class WorkerTemplate:
    """One loader process's misses, in order: (file index, offset, length), page aligned."""

    name: str
    ranges: list[tuple[int, int, int]] = field(default_factory=list)
    reads_per_byte: float = 1.0  # >1: the process read its weight bytes more than once (several passes)
    holds_mapped: bool = False  # still mapped weight files at exit: those tensors live in the page cache
    held_files: list[int] | None = None  # which files it still mapped at exit (None: unknown, take all of them)

    @property
    def bytes(self) -> int:
        """Bytes this worker reads."""
        return sum(r[2] for r in self.ranges)


@dataclass(slots=True)
class LoadTemplate:
    """A recorded load: the spec it belongs to, the files' identities and each worker's ordered ranges."""

    spec: dict[str, str]
    key: str
    files: list[FileIdentity]
    workers: list[WorkerTemplate]
    source: str  # "tracefs" or "residency": how the misses were observed
    record_seconds: float

    @property
    def bytes(self) -> int:
        """Bytes over all workers' ranges."""
        return sum(w.bytes for w in self.workers)

    @property
    def ranges(self) -> int:
        """Number of ranges over all workers."""
        return sum(len(w.ranges) for w in self.workers)

    def to_json(self) -> str:
        """Compact JSON; each worker's ranges are packed (see pack_ranges) to keep templates small."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "key": self.key,
            "spec": self.spec,
            "source": self.source,
            "record_seconds": round(self.record_seconds, 3),
            "files": [asdict(f) for f in self.files],
            "workers": [
                {
                    "name": w.name,
                    "reads_per_byte": w.reads_per_byte,
                    "holds_mapped": w.holds_mapped,
                    "held_files": w.held_files,
                    "ranges": pack_ranges(w.ranges),
                }
                for w in self.workers
            ],
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LoadTemplate:
        """Parse a template; any structural problem raises TemplateError with the reason."""
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise TemplateError(f"not a version {VERSION} load template")
            files = [FileIdentity(**f) for f in doc["files"]]
            workers = [_worker_from_json(w, len(files)) for w in doc["workers"]]
            return cls(
                dict(doc["spec"]), str(doc["key"]), files, workers, str(doc["source"]), float(doc["record_seconds"])
            )
        except TemplateError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TemplateError(f"corrupt ({type(exc).__name__}: {exc})") from None

    def check_ranges(self) -> str | None:
        """Why a range does not fit its file, or None when all fit."""
        for worker in self.workers:
            for f, offset, length in worker.ranges:
                size = self.files[f].size
                if offset < 0 or length <= 0 or offset >= size or offset + length > size + PAGE:
                    return (
                        f"range {offset}+{length} of {self.files[f].path} points past the end of the file "
                        f"({size} bytes)"
                    )
        return None


def pack_ranges(ranges: list[tuple[int, int, int]]) -> str:
    """Ranges as base64(zlib(int64 triples)): file, start page minus the previous range's end page, pages.

    Loaders read in regular strides, so the deltas repeat and compress to a few bytes per range.
    """
    flat, prev_end = [], 0
    for f, offset, length in ranges:
        start, pages = offset // PAGE, -(-length // PAGE)
        flat += [f, start - prev_end, pages]
        prev_end = start + pages
    return base64.b64encode(zlib.compress(struct.pack(f"<{len(flat)}q", *flat), 9)).decode()


def unpack_ranges(text: str) -> list[tuple[int, int, int]]:
    """Inverse of pack_ranges, in bytes."""
    raw = zlib.decompress(base64.b64decode(text.encode(), validate=True))
    if len(raw) % 24:
        raise TemplateError("corrupt (packed ranges are not whole triples)")
    flat = struct.unpack(f"<{len(raw) // 8}q", raw)
    out, prev_end = [], 0
    for i in range(0, len(flat), 3):
        f, delta, pages = flat[i : i + 3]
        start = prev_end + delta
        out.append((f, start * PAGE, pages * PAGE))
        prev_end = start + pages
    return out


def _worker_from_json(doc: dict, n_files: int) -> WorkerTemplate:
    try:
        ranges = unpack_ranges(doc["ranges"])
    except (zlib.error, binascii.Error, struct.error) as exc:
        raise TemplateError(f"corrupt (packed ranges: {exc})") from None
    if any(not 0 <= f < n_files for f, _, _ in ranges):
        raise TemplateError("corrupt (ranges do not match the file list)")
    held = doc.get("held_files")
    if held is not None and (
        not isinstance(held, list) or any(not isinstance(f, int) or not 0 <= f < n_files for f in held)
    ):
        raise TemplateError("corrupt (held_files do not match the file list)")
    return WorkerTemplate(
        str(doc["name"]), ranges, float(doc.get("reads_per_byte", 1.0)), bool(doc.get("holds_mapped", False)), held
    )
