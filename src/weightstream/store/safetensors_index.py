"""Parse safetensors headers ourselves: for every tensor, its file, absolute byte offset, length, dtype, shape."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from weightstream.errors import WeightstreamError
from weightstream.store.dtypes import ELEMENT_BYTES

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes live on disk."""

    name: str
    path: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Return every tensor of one .safetensors file; raise WeightstreamError on a malformed file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightstreamError(
                    f"{path}: truncated safetensors file ({size} bytes, no header length); "
                    "re-download or re-export the checkpoint"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:
                raise WeightstreamError(
                    f"{path}: safetensors header of {header_len} bytes exceeds the format's "
                    f"{MAX_HEADER_BYTES} byte limit; the file is corrupt or not safetensors"
                )
            if 8 + header_len > size:
                raise WeightstreamError(
                    f"{path}: truncated safetensors header (needs {header_len} bytes, file has "
                    f"{size - 8}); re-download or re-export the checkpoint"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise WeightstreamError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, an integer of 4300+ digits
        raise WeightstreamError(f"{path}: safetensors header is not valid JSON ({exc}); the file is corrupt") from exc
    if not isinstance(header, dict):
        raise WeightstreamError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    tensors = {name: _tensor_info(path, name, entry, data_start, size) for name, entry in header.items()}
    _check_no_overlap(path, tensors.values())
    return tensors


def _tensor_info(path: str, name: str, entry, data_start: int, size: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise WeightstreamError(f"{path}: tensor {name!r} lacks dtype, shape or data_offsets; the file is corrupt")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ELEMENT_BYTES:
        raise WeightstreamError(
            f"{path}: tensor {name!r} has unknown dtype {_shown(dtype)}; supported: {', '.join(sorted(ELEMENT_BYTES))}"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WeightstreamError(
            f"{path}: tensor {name!r} has invalid shape {_shown(shape)}, not a list of sizes 0 or more; the file is "
            "corrupt: re-download or re-export the checkpoint"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise WeightstreamError(
            f"{path}: tensor {name!r} has invalid data_offsets {_shown(offsets)}, not [begin, end]; the file is "
            "corrupt: re-download or re-export the checkpoint"
        )
    (begin, end), shape = offsets, tuple(shape)
    if not 0 <= begin <= end:
        raise WeightstreamError(f"{path}: tensor {name!r} has invalid data_offsets {[begin, end]}")
    if data_start + end > size:
        raise WeightstreamError(
            f"{path}: tensor {name!r} ends at byte {data_start + end}, past the end of the "
            f"file ({size} bytes); the file is truncated"
        )
    expected = math.prod(shape) * ELEMENT_BYTES[dtype]
    if end - begin != expected:
        raise WeightstreamError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but {dtype}{list(shape)} "
            f"needs {expected}; the file is corrupt"
        )
    return TensorInfo(name, path, data_start + begin, end - begin, dtype, shape)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_no_overlap(path: str, tensors) -> None:
    previous = None
    for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if previous is not None and t.offset < previous.offset + previous.nbytes and t.nbytes:
            raise WeightstreamError(f"{path}: tensors {previous.name!r} and {t.name!r} overlap; the file is corrupt")
        if t.nbytes:
            previous = t
