"""Write a .safetensors file tensor by tensor, with tensor data 64-byte aligned where the format allows.

The format forbids holes between tensors, so alignment comes from padding the JSON header (trailing spaces,
as the reference writer pads to 8) and from placing tensors whose size is a multiple of 64 first. Aligned
tensors matter to weightstream: an expert read with O_DIRECT is used where it lands only if it sits at the
address transformers' in-memory copy would (some CPU kernels round differently by alignment). Within each
group tensors go by name, as the reference writer orders them: an expert's tensors end up side by side.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import torch

from weightstream.store.dtypes import safetensors_name

ALIGN = 64


class SafetensorsWriter:
    """Lay out the file from (name, dtype, shape) up front; then `write` each tensor, in any order, once."""

    def __init__(
        self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ):
        self.path = path
        sizes = {name: math.prod(shape) * _itemsize(dtype) for name, (dtype, shape) in specs.items()}
        order = sorted(specs, key=lambda n: (sizes[n] % ALIGN != 0, n))  # by name, as the reference writer
        header, offset = {}, 0
        for name in order:
            dtype, shape = specs[name]
            header[name] = {
                "dtype": safetensors_name(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + sizes[name]],
            }
            offset += sizes[name]
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-(8 + len(raw))) % ALIGN)
        self.data_start = 8 + len(raw)
        self.total_bytes = self.data_start + offset
        self._spans = {name: header[name]["data_offsets"] for name in order}
        self._specs = specs
        self._written: set[str] = set()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes at its place; its dtype and shape must be those announced."""
        dtype, shape = self._specs[name]
        assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape), (name, tensor.dtype, tensor.shape)
        assert name not in self._written, name
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        begin, end = self._spans[name]
        assert len(data) == end - begin, name
        view, pos = memoryview(data), self.data_start + begin
        while len(view):
            done = os.pwrite(self._fd, view, pos)
            view, pos = view[done:], pos + done
        self._written.add(name)

    def close(self) -> None:
        """Check every tensor was written, flush to disk and close."""
        missing = set(self._specs) - self._written
        try:
            assert not missing, f"{self.path}: tensors never written: {sorted(missing)[:5]}"
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            os.close(self._fd)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def save_aligned(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with the data laid out by SafetensorsWriter."""
    with SafetensorsWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata) as w:
        for name, tensor in tensors.items():
            w.write(name, tensor)


def write_shards(
    out: str,
    shards: dict[int, list],
    specs_of: Callable[[object], dict[str, tuple[torch.dtype, tuple[int, ...]]]],
    write_item: Callable[[SafetensorsWriter, object], None],
) -> int:
    """A sharded checkpoint in `out`: one safetensors file per key of `shards` (a decoder layer; -1, the embeddings,
    final norm and head, sorts first), each holding its items' tensors (`specs_of(item)`: name -> (dtype, shape),
    written by `write_item(writer, item)`), and the index naming each tensor's file. `weightstream quantize` and
    `weightstream import` both write their output this way. Returns the bytes of tensor data written."""
    from weightstream.store.checkpoint import INDEX_NAME

    weight_map, total = {}, 0
    for i, layer in enumerate(sorted(shards)):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        specs = {}
        for item in shards[layer]:
            specs |= specs_of(item)
        with SafetensorsWriter(os.path.join(out, file), specs, metadata={"format": "pt"}) as writer:
            for item in shards[layer]:
                write_item(writer, item)
            total += writer.total_bytes
        weight_map |= dict.fromkeys(specs, file)
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return total
