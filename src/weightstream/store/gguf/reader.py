"""Reading GGUF files: the header through the gguf package's GGUFReader (every tensor's byte range checked against
the file size before the reader maps it), split models (`-0000i-of-0000N.gguf`) as one, and tensor bytes by
positioned reads (pread), never through the reader's memory map: a mapped page once read stays in the process's
resident set until the kernel evicts it, so a file larger than memory would count whole."""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.errors import WeightstreamError

FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MISSING = object()  # `GgufFile.value`'s default: the key is required


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of a GGUF file: its GGML type, its shape outermost first (GGUF lists dims the other way round),
    and where its bytes are."""

    name: str
    type: str
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(self.rows, 1)


@dataclass(slots=True)
class GgufFile:
    """A GGUF model, one file or every part of a split one: the first part's metadata and all parts' tensors."""

    path: str
    parts: list[str]
    fields: dict
    tensors: dict[str, GgufTensor]

    def value(self, key: str, default=MISSING, why: str = "", kind=None):
        """The value of metadata key `key`, checked to be of `kind` (int: a whole number 0 or more, float: a finite
        number, str, bool, list: an array; a tuple: any of them), by default the default's kind (a whole number
        where the default is None or the key is required)."""
        if key in self.fields:
            try:
                value = self.fields[key].contents()
            except UnicodeDecodeError:
                raise WeightstreamError(
                    f"{self.path}: metadata key {key!r} holds text that is not UTF-8; the file is damaged: download "
                    "or convert it again"
                ) from None
            if kind is None:
                kind = type(default) if isinstance(default, (bool, int, float, str)) else int
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if not any(_KIND_CHECKS[k](value) for k in kinds):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise WeightstreamError(
                    f"{self.path}: metadata key {key!r} is {shown}, not {' or '.join(_KIND_NAMES[k] for k in kinds)}"
                    f"{f' ({why})' if why else ''}; the file is damaged or was not made by llama.cpp's converter: "
                    "convert the model again with a current llama.cpp (convert_hf_to_gguf.py)"
                )
            return value
        if default is MISSING:
            raise WeightstreamError(
                f"{self.path}: metadata key {key!r} is missing{f' ({why})' if why else ''}; config.json cannot be "
                "written without it. The file was not made by llama.cpp's converter or is damaged: convert the "
                "model again with a current llama.cpp (convert_hf_to_gguf.py)"
            )
        return default

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.parts)


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_KIND_CHECKS = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _FLOAT32_MAX,  # not NaN
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, (bool, int)),
    list: lambda v: isinstance(v, list),
}
_KIND_NAMES = {
    int: "a whole number 0 or more",
    float: "a finite float32 number",
    str: "text",
    bool: "a boolean",
    list: "an array",
}


def open_gguf(path: str) -> GgufFile:
    """Parse a GGUF file (or every part of a `-0000i-of-0000N.gguf` split); errors name the file and the fault."""
    parts = gguf_parts(path)
    readers = [_read_part(p) for p in parts]
    tensors: dict[str, GgufTensor] = {}
    for i, (part, reader) in enumerate(zip(parts, readers, strict=True)):
        if len(parts) > 1:
            _check_split(part, reader, i, len(parts))
        for t in reader.tensors:
            if t.name in tensors:
                raise WeightstreamError(
                    f"{part}: tensor {t.name!r} is also in {tensors[t.name].path}; the parts do not belong together"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[t.name] = GgufTensor(t.name, t.tensor_type.name, shape, part, int(t.data_offset), int(t.n_bytes))
    first = readers[0]
    if len(parts) > 1:
        want = first.fields["split.tensors.count"].contents() if "split.tensors.count" in first.fields else None
        if want is not None and want != len(tensors):
            raise WeightstreamError(
                f"{parts[0]}: the split says {want} tensors, its {len(parts)} parts hold {len(tensors)}; a part is "
                "damaged or from another split: download or split the model again"
            )
    return GgufFile(parts[0], parts, dict(first.fields), tensors)


def gguf_parts(path: str) -> list[str]:
    """Every part of a split GGUF (`name-00001-of-00003.gguf` ...), or the one file."""
    if not os.path.isfile(path):
        raise WeightstreamError(
            f"{path}: {'is a directory' if os.path.isdir(path) else 'no such file'}; pass a .gguf file (for a split "
            "model, any of its -0000i-of-0000N.gguf parts)"
        )
    match = _SPLIT.match(os.path.basename(path))
    if not match:
        return [path]
    count = int(match["count"])
    folder = os.path.dirname(path)
    parts = [os.path.join(folder, f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing or not 1 <= int(match["no"]) <= count:
        raise WeightstreamError(
            f"{path}: part {int(match['no'])} of a {count}-part GGUF; missing beside it: "
            f"{', '.join(missing) or 'none (the part number is out of range)'}. Put every part in one directory"
        )
    return parts


def _read_part(path: str):
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise WeightstreamError(f"{path}: cannot read it ({exc.strerror})") from None
    if len(head) < 8 or head[:4] != b"GGUF":
        what = "is empty" if size == 0 else f"starts with {head[:4]!r}, not b'GGUF'"
        raise WeightstreamError(f"{path}: not a GGUF file (it {what}); pass a model file in llama.cpp's GGUF format")
    version = struct.unpack("<I", head[4:])[0]
    if version not in (2, 3):
        big = version & 0xFFFF == 0 and version >> 16 in (2, 3)  # a big-endian file's version, read little-endian
        raise WeightstreamError(
            f"{path}: "
            + (
                "a big-endian GGUF; weightstream reads little-endian files: convert the model on a little-endian "
                "machine"
                if big
                else f"GGUF version {version}; this importer reads versions 2 and 3 (llama.cpp writes 3): update the "
                "gguf package (pip install -U gguf) or convert the model again with a current llama.cpp"
            )
        )
    try:
        return _checked_reader()(path)
    except WeightstreamError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, struct.error, TypeError) as exc:
        raise WeightstreamError(
            f"{path}: the GGUF header is damaged or cut short ({type(exc).__name__}: {exc}); the file is incomplete "
            "or corrupt: download or convert it again"
        ) from None


_READER = None


def _checked_reader():
    """GGUFReader, refusing a tensor whose bytes run past the end of its file before it maps them."""
    global _READER
    if _READER is not None:
        return _READER
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def __init__(self, path: str):
            self._ws_path = path
            super().__init__(path, "r")

        def _get(self, offset: int, dtype, count: int = 1, override_order=None):
            # the package's reader takes what is there: past the end of the file, an array of a count the file
            # cannot hold went on reading nothing (2^64 empty items, a hang); a value cut off reads short
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise ValueError(
                    f"{int(count)} value(s) of {np.dtype(dtype).name} at byte {int(offset)} run past the end of the "
                    f"file ({len(self.data)} bytes)"
                )
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for f in fields:
                _, name_data, _, dims, raw_type, offset = f.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise WeightstreamError(
                        f"{self._ws_path}: tensor {name!r} has GGML type id {int(raw_type[0])}, unknown to the gguf "
                        "package here; update it (pip install -U gguf) or convert the model to a common type"
                    ) from None
                block, type_size = GGML_QUANT_SIZES[kind]
                count = math.prod(int(d) for d in dims)
                start = start_offs + int(offset[0])
                end = start + count // block * type_size
                if count % block or end > size:
                    what = (
                        f"{count} values are not whole {kind.name} blocks of {block}"
                        if count % block
                        else f"its data (bytes {start} to {end}) runs past the end of the file ({size} bytes)"
                    )
                    raise WeightstreamError(
                        f"{self._ws_path}: tensor {name!r}: {what}; the file is truncated or damaged: download or "
                        "convert it again"
                    )
            super()._build_tensors(start_offs, fields)

    _READER = CheckedReader
    return _READER


def _check_split(part: str, reader, index: int, count: int) -> None:
    fields = reader.fields
    no = fields["split.no"].contents() if "split.no" in fields else None
    total = fields["split.count"].contents() if "split.count" in fields else None
    if no != index or total != count:
        raise WeightstreamError(
            f"{part}: its metadata says part {no} of {total} (counting from 0), its name part {index} of {count}; "
            "the parts were renamed or mixed up: use the files as llama.cpp's gguf-split wrote them"
        )


def read_at(fd: int, path: str, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes of an open file from `offset` (pread), or an error naming the file and the byte."""
    buf = np.empty(nbytes, dtype=np.uint8)
    view, pos = memoryview(buf), offset
    while len(view):
        got = os.preadv(fd, [view], pos)
        if got <= 0:
            raise WeightstreamError(
                f"{path}: short read at byte {pos} ({nbytes} bytes from {offset} expected); the file changed or was "
                "cut short while importing"
            )
        view, pos = view[got:], pos + got
    return buf


def decode(raw: np.ndarray, kind: str, rows: int, k: int) -> torch.Tensor:
    """float values (rows, k) of a tensor's bytes: the float types as they are, blocks through gguf's decoder."""
    if kind in FLOATS:
        return torch.frombuffer(raw, dtype=FLOATS[kind]).reshape(rows, k) if raw.size else torch.empty(rows, k)
    from gguf import quants

    return torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), ggml_kind(kind))).reshape(rows, k)


def read_values(t: GgufTensor, fds: dict[int | str, int]) -> torch.Tensor:
    """A whole tensor's values, decoded, in its own shape (outermost first); floats keep their type."""
    raw = read_at(fds[t.path], t.path, t.offset, t.nbytes)
    return decode(raw, t.type, t.rows, t.shape[-1]).reshape(t.shape)


def ggml_kind(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def dequantizable(kind: str) -> bool:
    """Whether the gguf package here can decode blocks of type `kind`."""
    from gguf import GGML_QUANT_SIZES, quants

    if kind in FLOATS:
        return True
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[ggml_kind(kind)][1]), np.uint8), ggml_kind(kind))
    except NotImplementedError:
        return False
    return True
