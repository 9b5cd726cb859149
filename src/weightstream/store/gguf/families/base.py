"""What the importer knows of one GGUF architecture: its config map (GGUF metadata -> transformers config fields)
and its tensor-name quirks. `Family` holds the rules every architecture shares; each module of this package
subclasses it for one `general.architecture`, overriding only what that architecture does differently."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.errors import WeightstreamError
from weightstream.store.gguf.reader import GgufFile, GgufTensor

Key = Callable[..., object]  # key(name, default=MISSING, why="", kind=None) -> metadata key `{arch}.{name}`, checked


def decimal(value: float) -> float:
    """A float32 from the metadata as the shortest decimal it stores (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


@dataclass(frozen=True, slots=True)
class DenseSource:
    """Where one dense checkpoint tensor comes from: one GGUF tensor, its rows maybe permuted back (`permute_heads`),
    or several joined by `build` (their decoded values, each in its GGUF shape -> the checkpoint tensor's values);
    `why_float` says why a joined tensor cannot keep the file's blocks."""

    parts: tuple[GgufTensor, ...]
    permute_heads: int | None = None
    build: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    why_float: str = ""


@dataclass(frozen=True, slots=True)
class Skipped:
    """GGUF tensors the transformers model has no place for, read by nobody, and the line that says so."""

    names: tuple[str, ...]
    note: str


class Family:
    """One GGUF architecture. The class attributes are the simple differences; the methods the rest."""

    arch = ""  # GGUF `general.architecture`
    label = ""  # how the list of supported architectures names it (default: `arch`)
    model_type = ""  # transformers' model_type it imports as (`config` may choose another per file)
    experts_field = "num_experts"  # config field: routed experts per layer
    width_field = "moe_intermediate_size"  # config field: one expert's intermediate size
    norm_topk: bool | None = None  # llama.cpp's default for `{arch}.expert_weights_norm` (None: no such field)
    float32_keys: tuple[str, ...] = ()  # checkpoint keys (suffixes) stored in float32 whatever the activation dtype
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint key suffix -> the one llama.cpp's converter names it by
    # the model's fused gate_up rows alternate gate and up (gpt-oss), where llama.cpp's ffn_gate_exps and
    # ffn_up_exps hold them apart: the blob interleaves their rows (and biases) instead of putting gate's first
    gate_up_interleaved = False

    # ------------------------------------------------------------------------------------------------- config

    def refuse(self, gf: GgufFile, key: Key) -> str | None:
        """Why this file is not imported although its architecture is (None: it is)."""
        return None

    def rope_parameters(self, gf: GgufFile, key: Key) -> dict | None:
        """transformers' rope_parameters for a file with rope scaling; None for plain rope (`rope_theta` only).
        Refused unless the family says how its scaling maps."""
        scaling = key("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise WeightstreamError(
                f"{gf.path}: rope scaling {scaling!r} ({self.arch}.rope.scaling.type); importing rope scaling is not "
                "supported yet: use a file converted without it"
            )
        return None

    def config(self, gf: GgufFile, key: Key, fields: dict) -> None:
        """Add or change the family's own config fields (`fields` holds the ones every family shares)."""

    # ------------------------------------------------------------------------------------------------ tensors

    def gguf_name(self, names, key: str, gf: GgufFile | None = None) -> str:
        """The GGUF tensor name of a checkpoint key, by the gguf package's name map (`names`); `gf`: the file whose
        metadata made the model that has `key` (named in the error)."""
        for old, new in self.renames:
            if key.endswith(old):
                key = key.removesuffix(old) + new
        base, _, suffix = key.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = key, ""
        name = names.get_name(base)
        if name is None:
            where = (
                f"{gf.path}: the model its metadata describes has {key}, a tensor no GGUF name is known for"
                if gf is not None
                else f"{key}: no GGUF tensor name is known for it"
            )
            raise WeightstreamError(
                f"{where} (gguf package {_gguf_version()})"
                + (
                    "; the metadata and the tensors disagree (a layer without expert tensors is a dense layer) or "
                    "the file is damaged: convert the model again"
                    if gf is not None
                    else ""
                )
            )
        return f"{name}.{suffix}" if suffix else name

    def permute_heads(self, key: str, config) -> int | None:
        """Heads whose rows llama.cpp's converter permuted for its rope in this tensor (None: not permuted)."""
        return None

    def dense_source(self, gf: GgufFile, key: str, shape: tuple[int, ...], names, config) -> DenseSource:
        """The GGUF tensor(s) of one dense checkpoint tensor, checked against the shape the config gives it."""
        t = self.tensor(gf, self.gguf_name(names, key, gf), key, config)
        check_shape(gf, t, shape, key, config)
        return DenseSource((t,), self.permute_heads(key, config))

    def kept_apart(self, key: str, source: DenseSource, config) -> list[tuple[str, GgufTensor, tuple[int, int]]]:
        """For a dense tensor the file stores as several (`source`, joined by `build`) whose blocks the native
        kernels run as they are: (checkpoint key, tensor, (rows, inputs)) of each, stored instead of the joined
        tensor (in a checkpoint with a table of blocks); [] to store the joined values."""
        return []

    def tensor(self, gf: GgufFile, name: str, key: str, config, also: str = "") -> GgufTensor:
        t = gf.tensors.get(name)
        if t is None:
            raise WeightstreamError(
                f"{gf.path}: tensor {name!r} ({key} of {config.model_type}) is missing{also}; the metadata and the "
                "tensors disagree or the file is damaged: convert the model again"
            )
        return t

    def skipped(self, gf: GgufFile, config) -> list[Skipped]:
        """Tensors of the file the model does not read: the next-token-prediction (MTP, nextn) layers llama.cpp's
        converter appends after the model's own (`{arch}.nextn_predict_layers`, block index >= the layer count)."""
        nextn = gf.value(f"{self.arch}.nextn_predict_layers", 0)
        if not nextn:
            return []
        first = config.num_hidden_layers
        names = tuple(sorted(n for n in gf.tensors if (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >= first))
        blocks = ", ".join(f"blk.{i}" for i in range(first, first + nextn))
        return [
            Skipped(
                names,
                f"skipped {nextn} next-token-prediction (MTP) layer(s) ({blocks}, {len(names)} tensors): transformers' "
                f"{config.model_type} does not run them (llama.cpp uses them only to draft tokens)",
            )
        ]


def check_shape(gf: GgufFile, t: GgufTensor, shape: tuple[int, ...], key: str, config) -> None:
    """A GGUF tensor holds as many values as the checkpoint tensor, in the same shape when it has as many dims."""
    if math.prod(t.shape) != math.prod(shape) or (len(t.shape) == len(shape) and t.shape != shape):
        raise WeightstreamError(
            f"{gf.path}: tensor {t.name!r} is shaped {list(t.shape)}, the {config.model_type} model the metadata "
            f"describes needs {list(shape)} for {key}; the metadata and the tensors disagree"
        )


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
