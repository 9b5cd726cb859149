"""Trace files: one .npz holding the flat arrays of a Trace plus a JSON header (format described in docs)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from weightstream.errors import WeightstreamError
from weightstream.trace.format import Trace
from weightstream.trace.shapes import ModelShape

FORMAT = "weightstream-trace"
VERSION = 1
ARRAYS = ("step_request", "step_phase", "step_tokens", "step_groups", "group_layer", "group_offsets", "experts")
# Smallest integer types that hold each array; expert ids and layers are small, offsets are not.
STORED = {
    "step_request": np.int32,
    "step_phase": np.uint8,
    "step_tokens": np.int32,
    "step_groups": np.int64,
    "group_layer": np.int16,
    "group_offsets": np.int64,
    "experts": np.int16,
}


def save(trace: Trace, path: str | os.PathLike) -> None:
    """Write `trace` to `path` (.npz) atomically: a crash never leaves a half-written trace under that name."""
    path = Path(path)
    trace.validate(str(path))
    header = {"format": FORMAT, "version": VERSION, "shape": trace.shape.to_dict(), "requests": trace.requests}
    arrays = {name: np.asarray(getattr(trace, name)).astype(STORED[name]) for name in ARRAYS}
    if trace.shape.n_experts > np.iinfo(np.int16).max:
        arrays["experts"] = trace.experts.astype(np.int32)
    if trace.weights is not None:
        arrays["weights"] = trace.weights.astype(np.float32)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; errors name the file and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise WeightstreamError(f"{path}: no such trace file; make one with `weightstream trace import` or `record`")
    if path.stat().st_size == 0:
        raise WeightstreamError(f"{path}: empty file, not a trace; re-run the import or record that wrote it")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = _header(path, data)
            missing = [name for name in ARRAYS if name not in data.files]
            if missing:
                raise WeightstreamError(f"{path}: trace lacks arrays {missing}; the file is damaged or not a trace")
            arrays = {name: data[name] for name in ARRAYS}
            weights = data["weights"] if "weights" in data.files else None
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise WeightstreamError(f"{path}: not a readable trace (.npz) file ({exc}); it may be truncated") from None
    try:
        shape = ModelShape(**header["shape"])
    except (TypeError, WeightstreamError) as exc:
        raise WeightstreamError(f"{path}: trace header has a malformed shape ({exc})") from None
    trace = Trace(
        shape,
        list(header["requests"]),
        arrays["step_request"].astype(np.int32),
        arrays["step_phase"].astype(np.uint8),
        arrays["step_tokens"].astype(np.int32),
        arrays["step_groups"].astype(np.int64),
        arrays["group_layer"].astype(np.int32),
        arrays["group_offsets"].astype(np.int64),
        arrays["experts"].astype(np.int32),
        None if weights is None else weights.astype(np.float32),
    )
    trace.validate(str(path))
    return trace


def _header(path: Path, data) -> dict:
    if "header" not in data.files:
        raise WeightstreamError(f"{path}: no trace header; this .npz was not written by weightstream")
    try:
        header = json.loads(bytes(data["header"]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightstreamError(f"{path}: trace header is not valid JSON ({exc})") from None
    if header.get("format") != FORMAT:
        raise WeightstreamError(f"{path}: header format {header.get('format')!r} is not {FORMAT!r}")
    if header.get("version") != VERSION:
        raise WeightstreamError(
            f"{path}: trace version {header.get('version')} is not supported (this build "
            f"reads version {VERSION}); re-import it with this weightstream"
        )
    return header
