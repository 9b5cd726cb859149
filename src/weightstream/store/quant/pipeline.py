"""`weightstream quantize`: rewrite a checkpoint's routed experts as int8 or int4 blobs, one expert at a time.

Never more than one expert (plus the largest dense tensor) in memory: each expert's bytes are read from the
source by the layout's byte ranges, quantized, packed and written into its blob's place in the output shard. The
output is built in a hidden directory beside the target and renamed into place only once complete, with the
manifest written last: an interrupted run leaves nothing that loads as a quantized checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import INDEX_NAME, read_bytes, read_tensor
from weightstream.store.dtypes import torch_dtype
from weightstream.store.layout import experts_modules, layer_index
from weightstream.store.model import map_model
from weightstream.store.outdir import built_in_place, refuse_existing
from weightstream.store.published import strip_quantization_config
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.manifest import MANIFEST, QuantFormat, blob_key, row_bytes, small_key, write_manifest
from weightstream.store.quant.options import QuantizeOptions
from weightstream.store.quant.plan import (
    blob_format,
    dense_plan,
    expert_blob,
    miss_copy_format,
    out_in,
    quantize_expert,
)
from weightstream.store.safetensors_index import TensorInfo
from weightstream.store.safetensors_writer import write_shards

SKIP_FILES = (".safetensors", INDEX_NAME, MANIFEST)


@dataclass(slots=True)
class QuantizeResult:
    out_dir: str
    scheme: str
    group_size: int | None
    experts: int
    expert_bytes_before: int  # one expert, source
    expert_bytes_after: int  # one expert's blob
    total_bytes: int
    seconds: float
    miss_bits: int | None = None  # --miss-bits: the small copies' bits
    miss_copy_bytes: int | None = None  # one expert's small copy
    # weights of the small copy that are not Q2_K / Q3_K, and the type they are (inputs not whole blocks of 256)
    miss_fallback: dict[str, str] | None = None


def quantize_checkpoint(
    src: str,
    out: str,
    bits: int | None = None,
    group_size: int | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    kernel: str = "auto",
    dense: str = "keep",
    miss_bits: int | None = None,
    *,
    options: QuantizeOptions | None = None,
) -> QuantizeResult:
    """Write `out`: `src` with every routed expert quantized as `options` say (store/quant/options.py), or as the
    keyword options build them (`bits`, `group_size`, `kernel`, `dense`, `miss_bits`: QuantizeOptions' fields).

    `kernel` decides the format: `native` stores GGML blocks the native kernels run (8 bits: Q8_0; 4 bits: Q4_K,
    or Q4_1 where an input size is not whole super-blocks of 256; 16 bits: BF16, the weights as bfloat16, not
    quantized); `torch` stores torch's packed layouts (8 bits: one scale per output channel; 4 bits: groups of
    `group_size`); `auto` is native where the native kernels are built and no `group_size` is given, else torch.
    `dense` (`keep`, `int8`, `int4`, `bf16`) stores the dense linear weights too (attention, shared experts, dense
    MLPs, an untied output head; not the router, norms or embeddings) in the same block formats, for the native
    kernels."""
    start = time.perf_counter()
    if options is None:
        options = QuantizeOptions(bits, group_size, kernel, dense, miss_bits)
    refuse_existing(out, force, sources=[src])
    mapped = map_model(src, convert=False)  # a published FP8 / MXFP4 source is read as published, expert by expert
    if mapped.quant is not None:
        also = " (with --miss-bits there, for small copies)" if options.miss_bits is not None else ""
        raise WeightstreamError(
            f"{src}: already quantized ({mapped.quant.scheme}); quantize the original checkpoint{also}"
        )
    modules = experts_modules(mapped.model)
    transposed = next(iter(modules.values())).is_transposed
    quant, fallback = _format(mapped, transposed, options)
    published = mapped.published
    with built_in_place(out, "quantize", needed=_output_bytes(mapped, quant)) as tmp:
        total = _write(mapped, modules, quant, transposed, tmp, progress)
        _copy_side_files(src, tmp)
        if published is not None:
            strip_quantization_config(os.path.join(tmp, "config.json"))
        write_manifest(tmp, quant)  # last: without it the directory is not a quantized checkpoint
    first = mapped.layout.experts[next(iter(mapped.layout.experts))]
    return QuantizeResult(
        out,
        quant.scheme,
        quant.group_size,
        len(mapped.layout.experts),
        published.stored_nbytes(first) if published is not None else first.nbytes,
        quant.blob_bytes,
        total,
        time.perf_counter() - start,
        options.miss_bits,
        quant.miss_copy.blob_bytes if quant.miss_copy else None,
        fallback,
    )


def _format(mapped, transposed: bool, options: QuantizeOptions) -> tuple[QuantFormat, dict[str, str] | None]:
    """The manifest's format for this source: the scheme (the options', else decided by the source), the blob
    table, the dense plan and the small copies' table; and the small copies' fallback weights (None without)."""
    layout, published = mapped.layout, mapped.published
    first = layout.experts[next(iter(layout.experts))]
    params = {p.name: (p.shape, p.dtype) for p in first.params}
    scheme = options.scheme
    weights = [p for p in first.params if len(p.shape) > 1]
    if scheme is None and published is not None and all(published.holds_mxfp4(p) for p in weights):
        scheme = "mxfp4"  # native 4-bit from MXFP4 experts: their own blocks, kept (re-quantizing rounds twice)
    if scheme is None:  # native 4-bit: Q4_K where every input size is whole super-blocks of 256, else Q4_1
        inputs = [out_in(shape, transposed)[1] for shape, _ in params.values() if len(shape) > 1]
        scheme = "q4_k" if all(k % 256 == 0 for k in inputs) else "q4_1"
    source = {
        "model_type": layout.model_type,
        "dtype": str(mapped.model.dtype).removeprefix("torch."),
        "expert_bytes": first.nbytes,
    }
    if published is not None:
        source["published"] = published.stamp()  # what a converted copy was made from (store/convert.py)
    quant = blob_format(params, transposed, scheme, options.group, mapped.model.dtype, source)
    if options.dense != "keep":
        quant = dataclasses.replace(quant, dense=dense_plan(mapped, options.dense))
    fallback = None
    if options.miss_bits is not None:
        miss, fallback = miss_copy_format(params, transposed, options.miss_bits, mapped.model.dtype)
        quant = dataclasses.replace(quant, miss_copy=miss)
    return quant, fallback


def _write(mapped, modules, quant: QuantFormat, transposed: bool, out: str, progress) -> int:
    """Shards by decoder layer: its dense tensors and its experts' blobs (and small copies, each beside its blob).
    Returns bytes written."""
    layout, published = mapped.layout, mapped.published
    read_stored = published.read_tensor if published is not None else read_tensor
    # what an encoder takes: float32, a published FP8 weight dequantized straight into it (not through bf16)
    read_float = (
        (lambda t: published.read_tensor(t, torch.float32)) if published else (lambda t: read_stored(t).float())
    )
    path_of = {layer: path for path, layer in layout.module_layers.items()}
    dense = {info.name: info for info in layout.dense.values()}
    shards: dict[int, dict] = {}
    for name, info in dense.items():
        shards.setdefault(layer_index(name, -1), {})[name] = info  # -1: embeddings, final norm, head: the first shard
    small = quant.miss_format() if quant.miss_copy else None
    small_keys = {}
    for (layer, expert), ex in layout.experts.items():
        shards.setdefault(layer, {})[blob_key(path_of[layer], expert)] = ex
        small_keys[blob_key(path_of[layer], expert)] = small_key(path_of[layer], expert)
    todo = sum(i.nbytes for i in dense.values()) + sum(e.nbytes for e in layout.experts.values())
    done = 0

    def write_item(writer, entry) -> None:
        nonlocal done
        key, item = entry
        if isinstance(item, TensorInfo) and key in (quant.dense or {}):
            writer.write(key, ENCODERS[quant.dense[key][0]](read_float(item)))
        elif isinstance(item, TensorInfo):
            writer.write(key, read_stored(item))
        else:  # the blob, and its small copy from the same weights read once
            tensors, small_tensors = _expert_tensors(item, transposed, quant, published, small)
            writer.write(key, expert_blob(tensors, quant))
            if small is not None:
                writer.write(small_keys[key], expert_blob(small_tensors, small))
        done += item.nbytes
        if progress:
            progress(done, todo)

    entries = {layer: list(items.items()) for layer, items in shards.items()}

    def specs(entry) -> dict:
        key, item = entry
        out = {key: _spec(key, item, quant)}
        if small is not None and not isinstance(item, TensorInfo):
            out[small_keys[key]] = (torch.uint8, (small.blob_bytes,))
        return out

    return write_shards(out, entries, specs, write_item)


def _output_bytes(mapped, quant: QuantFormat) -> int:
    """The tensor bytes `_write` stores: every dense tensor and every expert's blob (and small copy)."""
    blob = quant.blob_bytes + (quant.miss_copy.blob_bytes if quant.miss_copy else 0)
    dense = 0
    for info in mapped.layout.dense.values():
        dtype, shape = _spec(info.name, info, quant)
        dense += math.prod(shape) * dtype.itemsize
    return dense + blob * len(mapped.layout.experts)


def _expert_tensors(
    expert, transposed: bool, quant: QuantFormat, published, small: QuantFormat | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """One expert's blob tensors by name: its parameters read (a published source's dequantized, float32) and
    quantized, but MXFP4 blocks kept as they are where the blob stores MXFP4; and, with `small` (the small copies'
    format), its small copy's tensors from the same weights (None without)."""
    if published is None:
        params = {p.name: _read_param(p) for p in expert.params}
        return quantize_expert(params, transposed, quant), small and quantize_expert(params, transposed, small)
    kept = {}
    if quant.scheme == "mxfp4":
        kept = {f"{p.name}.qweight": published.mxfp4_rows(p) for p in expert.params if published.holds_mxfp4(p)}
    params = {p.name: published.read_param(p) for p in expert.params if small or f"{p.name}.qweight" not in kept}
    blob = {n: w for n, w in params.items() if f"{n}.qweight" not in kept}
    return {**quantize_expert(blob, transposed, quant), **kept}, small and quantize_expert(params, transposed, small)


def _spec(key: str, item, quant: QuantFormat) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(item, TensorInfo) and key in (quant.dense or {}):
        wtype, (n, k) = quant.dense[key]
        return torch.uint8, (n, row_bytes(wtype, k))
    if isinstance(item, TensorInfo):
        return torch_dtype(item.dtype), tuple(item.shape)
    return torch.uint8, (quant.blob_bytes,)


def _read_param(param) -> torch.Tensor:
    raw = torch.cat([read_bytes(p.path, p.offset, p.nbytes) for p in param.pieces])
    return raw.view(param.dtype).reshape(param.shape)


def _copy_side_files(src: str, out: str) -> None:
    """config.json, tokenizer, generation config: everything but the weights and their index."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(SKIP_FILES):
            shutil.copy2(path, os.path.join(out, name))
