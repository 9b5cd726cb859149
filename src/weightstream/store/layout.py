"""Where each expert's bytes live in a checkpoint, derived from transformers' own conversion mapping.

transformers knows, per architecture, how checkpoint tensors become model parameters: per-expert tensors
(`experts.7.gate_proj.weight`, Mixtral's `w1/w3/w2`) merged along a new expert dimension and concatenated
into `gate_up_proj`, or fused tensors (`experts.gate_up_proj`) used as they are. We run the same mapping
over the checkpoint's keys and keep, for each (layer, expert), the byte ranges that make up each of its
parameters in the model's own layout and execution order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from weightstream.errors import WeightstreamError
from weightstream.io.aligned import region_bytes
from weightstream.store.checkpoint import Checkpoint
from weightstream.store.quant.manifest import QuantFormat, blob_key, small_key
from weightstream.store.safetensors_index import TensorInfo

TESTED_ARCHITECTURES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe",
    "gpt_oss",
)
_EXEC_ORDER = {
    "gate_up_proj": 0,
    "up_proj": 0,
    "gate_up_proj_bias": 1,
    "up_proj_bias": 1,
    "down_proj": 2,
    "down_proj_bias": 3,
}


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous byte range of a checkpoint file."""

    path: str
    offset: int
    nbytes: int


MEMORY_ALIGN = 64  # torch's CPU allocator aligns to 64 bytes


@dataclass(frozen=True, slots=True)
class ExpertParam:
    """One parameter of one expert in the model's layout: its shape, dtype and the pieces it concatenates.

    `residue` is its address modulo MEMORY_ALIGN in transformers' own in-memory model: some CPU kernels give
    different results for differently aligned weights (fp32 gemv: 4 or 8 bytes off 16 changes the last bit),
    so the cache places each parameter at the residue eager computes it at.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    residue: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Every parameter of one expert of one layer, in execution order (gate, up, down; biases after each)."""

    layer: int
    expert: int
    params: tuple[ExpertParam, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def pieces(self) -> list[Piece]:
        return [piece for param in self.params for piece in param.pieces]

    @property
    def slot_bytes(self) -> int:
        return sum(region_bytes(p.nbytes) for p in self.pieces)


@dataclass(slots=True)
class ModelLayout:
    """Expert byte ranges for a whole model, plus the dense tensors to load into memory."""

    model_type: str
    experts: dict[tuple[int, int], ExpertLayout]
    module_layers: dict[str, int]  # experts module path -> layer index
    num_experts: dict[int, int]
    top_k: int
    dense: dict[str, TensorInfo]  # model parameter name -> checkpoint tensor
    # each expert's small copy (`quantize --miss-bits`; read on a miss under `--miss-copy`); None: there are none
    small_copies: dict[tuple[int, int], ExpertLayout] | None = None

    @property
    def layers(self) -> list[int]:
        return sorted(self.num_experts)

    @property
    def slot_bytes(self) -> int:
        return max(e.slot_bytes for e in self.experts.values())

    @property
    def working_set_bytes(self) -> int:
        """One token's expert bytes as the cache holds them: MoE layers x top-k x slot size."""
        return len(self.num_experts) * self.top_k * self.slot_bytes

    def expert_bytes_total(self) -> int:
        return sum(e.nbytes for e in self.experts.values())


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules whose forward goes through transformers' experts interface, by path."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")}


def streamable_modules(model: torch.nn.Module, model_dir: str) -> dict[str, torch.nn.Module]:
    """The experts modules, or an error naming the architecture and the supported ones."""
    modules = experts_modules(model)
    if not modules:
        raise WeightstreamError(
            f"{model_dir}: architecture {model.config.model_type!r} has no experts module that goes through "
            f"transformers' experts interface, so weightstream cannot stream it; supported (tested): "
            f"{', '.join(TESTED_ARCHITECTURES)}"
        )
    return modules


def build_layout(model: torch.nn.Module, ckpt: Checkpoint, top_k: int, quant: QuantFormat | None = None) -> ModelLayout:
    """Map every checkpoint tensor onto the (meta) model: expert pieces per (layer, expert), dense tensors.

    A quantized checkpoint (`quant`) keeps each expert as one blob whose tensors the manifest lists.
    """
    model_type = model.config.model_type
    modules = streamable_modules(model, ckpt.model_dir)
    module_layers = {path: layer_index(path, i) for i, path in enumerate(modules)}
    params = {f"{path}.{n}": (path, n, p) for path, m in modules.items() for n, p in m.named_parameters(recurse=False)}
    found: dict[tuple[str, int, str], list[tuple[int, Piece]]] = {}
    fused: set[tuple[str, str]] = set()  # (module path, param) stored fused on disk: transformers maps it as is
    dense: dict[str, TensorInfo] = {}
    blobs = _blob_experts(ckpt, modules, module_layers, quant) if quant is not None else {}
    small = None
    if quant is not None and quant.miss_copy is not None:
        table = (quant.miss_copy.tensors, quant.miss_copy.blob_bytes)
        small = _blob_experts(ckpt, modules, module_layers, quant, small_key, table)
    keys = (blob_key, small_key)
    blob_keys = (
        {key(path, e) for path, m in modules.items() for e in range(m.num_experts) for key in keys} if quant else set()
    )
    for key, info in ckpt.tensors.items():
        if key in blob_keys:
            continue
        target, converter, position = _map_key(model, key)
        if target in params:
            _add_pieces(found, params[target], key, info, converter, position, model_type)
            if converter is None:
                fused.add(params[target][:2])
        elif converter is not None:
            raise WeightstreamError(
                f"{ckpt.model_dir}: tensor {key!r} of architecture {model_type!r} needs a "
                f"conversion weightstream does not support for dense weights"
            )
        else:
            dense[target] = info
    experts = blobs or _assemble(found, fused, modules, module_layers, params, ckpt.model_dir)
    num_experts = {module_layers[p]: m.num_experts for p, m in modules.items()}
    return ModelLayout(model_type, experts, module_layers, num_experts, top_k, dense, small)


def _blob_experts(
    ckpt: Checkpoint, modules, module_layers, quant: QuantFormat, key=blob_key, table=None
) -> dict[tuple[int, int], ExpertLayout]:
    """Each expert's tensors inside its blob, as the manifest lists them (all at the blob's own alignment); `key` and
    `table` (table, bytes) for the small copies instead (`quant.miss_copy`)."""
    experts = {}
    for path, module in modules.items():
        layer = module_layers[path]
        tensors, blob_bytes = table or quant.table(layer)
        for e in range(module.num_experts):
            info = ckpt.tensors.get(key(path, e))
            if info is None or info.dtype != "U8" or info.nbytes != blob_bytes:
                got = "missing" if info is None else f"{info.dtype} of {info.nbytes} bytes"
                raise WeightstreamError(
                    f"{ckpt.model_dir}: expert blob {key(path, e)!r} is {got}; the manifest "
                    f"says U8 of {blob_bytes} bytes (re-run `weightstream quantize`)"
                )
            experts[(layer, e)] = ExpertLayout(
                layer,
                e,
                tuple(
                    ExpertParam(t.name, *t.storage, (Piece(info.path, info.offset + t.offset, t.nbytes),))
                    for t in tensors
                ),
            )
    return experts


def layer_index(path: str, fallback: int) -> int:
    """The N of `.layers.N.` in a module or parameter name, else `fallback`: the one reading of a layer number from
    a name (layouts, shards, the GGUF importer's plans, the page-cache model's dense spans)."""
    match = re.search(r"\.layers\.(\d+)\.", f".{path}.")
    return int(match.group(1)) if match else fallback


def _transforms(model):
    cached = getattr(model, "_ws_transforms", None)
    if cached is None:
        transforms = get_model_conversion_mapping(model)
        cached = (
            [t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)],
            {k: None for k in model.state_dict(keep_vars=True)},
        )
        model._ws_transforms = cached
    return cached


def _map_key(model, key: str) -> tuple[str, WeightConverter | None, int]:
    """Checkpoint key -> (model parameter, the converter that merges it or None, its position among sources)."""
    renamings, converters, meta = _transforms(model)
    target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
    if pattern is None:
        return target, None, 0
    converter = next(c for c in converters if pattern in c.source_patterns)
    return target, converter, converter.source_patterns.index(pattern)


def _add_pieces(found, param, key, info: TensorInfo, converter, position, model_type) -> None:
    path, name, meta_param = param
    num_experts = meta_param.shape[0]
    if converter is None:  # fused on disk: expert e is the e-th contiguous slice along dim 0
        if tuple(info.shape) != tuple(meta_param.shape):
            raise WeightstreamError(
                f"{info.path}: tensor {key!r} has shape {list(info.shape)}, the model expects "
                f"{list(meta_param.shape)}; config.json and the weights disagree"
            )
        stride = info.nbytes // num_experts
        for e in range(num_experts):
            found.setdefault((path, e, name), []).append((0, Piece(info.path, info.offset + e * stride, stride)))
        return
    ops = [type(op) for op in converter.operations]
    if (
        ops not in ([MergeModulelist], [MergeModulelist, Concatenate])
        or converter.operations[0].dim != 0
        or (len(ops) == 2 and converter.operations[1].dim != 1)
    ):
        raise WeightstreamError(
            f"architecture {model_type!r}: its experts are converted by {ops}, which weightstream "
            f"cannot map to byte ranges; supported (tested): {', '.join(TESTED_ARCHITECTURES)}"
        )
    pattern = re.escape(converter.source_patterns[position]).replace(r"\*", r"(\d+)")
    expert = int(re.search(pattern, key).group(1))
    found.setdefault((path, expert, name), []).append((position, Piece(info.path, info.offset, info.nbytes)))


def _assemble(found, fused, modules, module_layers, params, model_dir) -> dict[tuple[int, int], ExpertLayout]:
    experts = {}
    for path, module in modules.items():
        names = sorted((n for p, n, _ in params.values() if p == path), key=lambda n: (_EXEC_ORDER.get(n, 9), n))
        for e in range(module.num_experts):
            experts[(module_layers[path], e)] = ExpertLayout(
                module_layers[path],
                e,
                tuple(_expert_param(found, path, e, n, params, model_dir, (path, n) in fused) for n in names),
            )
    return experts


def _expert_param(found, path, e, name, params, model_dir, fused: bool) -> ExpertParam:
    meta_param = params[f"{path}.{name}"][2]
    shape = tuple(meta_param.shape[1:])
    pieces = tuple(p for _, p in sorted(found.get((path, e, name), []), key=lambda t: t[0]))
    need = math.prod(shape) * meta_param.element_size()
    if sum(p.nbytes for p in pieces) != need:
        raise WeightstreamError(
            f"{model_dir}: expert {e} of {path}.{name} has {sum(p.nbytes for p in pieces)} bytes "
            f"in the checkpoint, the model expects {need}; tensors are missing or the wrong dtype"
        )
    # fused on disk, transformers uses the file's bytes where mmap put them; merged, a new (E, ...) tensor
    residue = pieces[0].offset % MEMORY_ALIGN if fused else e * need % MEMORY_ALIGN
    return ExpertParam(name, shape, meta_param.dtype, pieces, residue)
