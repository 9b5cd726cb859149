"""A model directory: config.json plus one or many safetensors shards, indexed tensor by tensor."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch

from weightstream.errors import WeightstreamError
from weightstream.store.dtypes import torch_dtype
from weightstream.store.model_dir import gguf_hint
from weightstream.store.safetensors_index import TensorInfo, read_safetensors_header

INDEX_NAME = "model.safetensors.index.json"


@dataclass(slots=True)
class Checkpoint:
    """Every tensor of a checkpoint directory, by name."""

    model_dir: str
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return sorted({t.path for t in self.tensors.values()})

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def open_checkpoint(model_dir: str) -> Checkpoint:
    """Index a model directory; raise WeightstreamError naming what is missing or malformed."""
    if not os.path.isdir(model_dir):
        if model_dir.lower().endswith(".gguf"):
            raise WeightstreamError(gguf_hint(model_dir))
        raise WeightstreamError(
            f"{model_dir}: not a directory; pass a model directory holding config.json and "
            "*.safetensors (for example one written by `weightstream synth`)"
        )
    config = _read_json(os.path.join(model_dir, "config.json"), "config.json")
    ckpt = Checkpoint(model_dir, config)
    for path in _shard_paths(model_dir):
        for name, info in read_safetensors_header(path).items():
            if name in ckpt.tensors:
                raise WeightstreamError(
                    f"{model_dir}: tensor {name!r} appears in both "
                    f"{ckpt.tensors[name].path} and {path}; the checkpoint is inconsistent"
                )
            ckpt.tensors[name] = info
    return ckpt


def _shard_paths(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path, INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightstreamError(f"{index_path}: no weight_map; the index is corrupt")
        odd = [s for s in weight_map.values() if not _inside(s)]
        if odd:
            shown = repr(odd[0]) if len(repr(odd[0])) <= 60 else repr(odd[0])[:57] + "..."
            raise WeightstreamError(
                f"{index_path}: weight_map names shard {shown}, not the name of a file in {model_dir}; the index is "
                "corrupt: download or copy it again"
            )
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise WeightstreamError(
                f"{index_path}: names shard(s) {', '.join(missing)} that are missing from "
                f"{model_dir}; download or copy the missing files"
            )
        return [os.path.join(model_dir, s) for s in shards]
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise WeightstreamError(f"{model_dir}: no *.safetensors files; weightstream reads safetensors checkpoints only")
    return paths


def _inside(shard) -> bool:
    """Whether a weight_map value names a file under the model directory (a relative path that stays inside it)."""
    if not isinstance(shard, str) or not shard or "\0" in shard or os.path.isabs(shard):
        return False
    norm = os.path.normpath(shard)
    return norm not in (".", "..") and not norm.startswith(".." + os.sep)


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise WeightstreamError(f"{path}: missing {what}; a model directory needs it") from exc
    except OSError as exc:
        raise WeightstreamError(
            f"{path}: cannot read {what} ({exc.strerror}); a model directory needs it as a file"
        ) from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, an integer of 4300+ digits
        raise WeightstreamError(f"{path}: {what} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise WeightstreamError(f"{path}: {what} is not a JSON object")
    return data


def read_bytes(path: str, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `path` from `offset`, as uint8, by a positioned read (no memory map: what is read once does
    not stay in the process's resident set)."""
    buf = bytearray(nbytes)
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(buf) != nbytes:
            raise WeightstreamError(f"{path}: short read at byte {offset} ({nbytes} bytes expected); the file changed")
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor of a safetensors file, read as `read_bytes` does, in its dtype and shape."""
    return read_bytes(info.path, info.offset, info.nbytes).view(torch_dtype(info.dtype)).reshape(info.shape)
