"""Trace files: one .npz holding the flat arrays of a Trace plus a JSON header (format described in docs)."""

from __future__ import annotations

import json
import os
import zipfile
import zlib
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
    # RuntimeError: zipfile's for an encrypted member, and (NotImplementedError) an unknown compression or version
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RuntimeError) as exc:
        raise WeightstreamError(f"{path}: not a readable trace (.npz) file ({exc}); it may be truncated") from None
    try:
        shape = ModelShape(**header["shape"])
    except (TypeError, WeightstreamError) as exc:
        raise WeightstreamError(f"{path}: trace header has a malformed shape ({exc})") from None
    trace = Trace(
        shape,
        list(header["requests"]),
        _ints(path, "step_request", arrays, np.int32),
        _ints(path, "step_phase", arrays, np.uint8),
        _ints(path, "step_tokens", arrays, np.int32),
        _ints(path, "step_groups", arrays, np.int64),
        _ints(path, "group_layer", arrays, np.int32),
        _ints(path, "group_offsets", arrays, np.int64),
        _ints(path, "experts", arrays, np.int32),
        None if weights is None else _floats(path, weights),
    )
    trace.validate(str(path))
    return trace


def _ints(path: Path, name: str, arrays: dict, dtype) -> np.ndarray:
    """Array `name` as `dtype`, or an error naming the file: a list of integers that `dtype` holds (a cast would
    wrap a value past it into another trace)."""
    a, info = arrays[name], np.iinfo(dtype)
    if a.ndim != 1 or a.dtype.kind not in "iu" or (len(a) and (a.min() < info.min or a.max() > info.max)):
        what = f"{a.dtype} values shaped {list(a.shape)}" if a.ndim != 1 or a.dtype.kind not in "iu" else "values"
        raise WeightstreamError(
            f"{path}: array {name!r} holds {what} where a list of integers in {info.min}..{info.max} belongs; the "
            "file is damaged or not a trace: re-run the import or record that wrote it"
        )
    return a.astype(dtype)


def _floats(path: Path, a: np.ndarray) -> np.ndarray:
    """The router weights as float32, or an error naming the file: a list of finite numbers float32 holds."""
    if a.ndim != 1 or a.dtype.kind not in "fiu" or not (np.abs(a.astype(np.float64)) <= np.finfo(np.float32).max).all():
        raise WeightstreamError(
            f"{path}: array 'weights' holds {a.dtype} values shaped {list(a.shape)} where a list of router weights "
            "(finite float32 numbers) belongs; the file is damaged or not a trace: re-run the import or record that "
            "wrote it"
        )
    return a.astype(np.float32)


def _header(path: Path, data) -> dict:
    if "header" not in data.files:
        raise WeightstreamError(f"{path}: no trace header; this .npz was not written by weightstream")
    try:
        header = json.loads(bytes(data["header"]).decode())
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, an integer of 4300+ digits
        raise WeightstreamError(f"{path}: trace header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightstreamError(f"{path}: trace header is JSON {type(header).__name__}, not an object; not a trace")
    if header.get("format") != FORMAT:
        raise WeightstreamError(f"{path}: header format {header.get('format')!r} is not {FORMAT!r}")
    if header.get("version") != VERSION:
        raise WeightstreamError(
            f"{path}: trace version {header.get('version')} is not supported (this build "
            f"reads version {VERSION}); re-import it with this weightstream"
        )
    shape, requests = header.get("shape"), header.get("requests")
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    if not (
        isinstance(shape, dict)
        and all(isinstance(shape.get(k), list) and all(map(whole, shape[k])) for k in ("layers", "expert_bytes"))
        and whole(shape.get("n_experts"))
        and whole(shape.get("top_k"))
    ):
        shown = repr(shape) if len(repr(shape)) <= 80 else repr(shape)[:77] + "..."
        raise WeightstreamError(
            f"{path}: trace header has a malformed shape ({shown}); it needs whole numbers for layers, n_experts, "
            "top_k and expert_bytes: the file is damaged; re-run the import or record that wrote it"
        )
    if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
        raise WeightstreamError(
            f"{path}: trace header's requests are not a list of names; the file is damaged: re-run the import or "
            "record that wrote it"
        )
    return header
