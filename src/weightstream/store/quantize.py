"""`weightstream quantize`: rewrite a checkpoint's routed experts as int8 or int4 blobs, one expert at a time.

Never more than one expert (plus the largest dense tensor) in memory: each expert's bytes are read from the
source by the layout's byte ranges, quantized, packed and written into its blob's place in the output shard. The
output is built in a hidden directory beside the target and renamed into place only once complete, with the
manifest written last: an interrupted run leaves nothing that loads as a quantized checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightstream import native
from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import INDEX_NAME, read_bytes, read_tensor
from weightstream.store.dtypes import torch_dtype, torch_name
from weightstream.store.facts import ties_embeddings
from weightstream.store.ggml_quant import ENCODERS
from weightstream.store.layout import experts_modules, layer_index
from weightstream.store.model import map_model
from weightstream.store.outdir import built_in_place, refuse_existing
from weightstream.store.published import strip_quantization_config
from weightstream.store.quant import (
    INT4_GROUPS,
    quantize_int4,
    quantize_int8,
    torch_int4_layout,
)
from weightstream.store.quant_format import (
    BLOCK_TYPES,
    GGML_SCHEMES,
    MANIFEST,
    MISS_BITS,
    MissCopy,
    QuantFormat,
    blob_key,
    blob_layout,
    row_bytes,
    small_key,
    write_manifest,
)
from weightstream.store.safetensors_index import TensorInfo
from weightstream.store.safetensors_writer import write_shards

DEFAULT_GROUP = 128  # torch int4: see docs/quantization.md for the measured choice
KERNELS = ("auto", "native", "torch")
DENSE_CHOICES = ("keep", "int8", "int4", "bf16")
DENSE_TYPES = {"int8": "Q8_0", "bf16": "BF16"}  # int4: Q4_K where inputs are whole super-blocks of 256, else Q4_1
# Linear modules that stay in the source precision under --dense: routers (a wrong expert is a different model)
KEEP_DENSE = ("gate", "router", "shared_expert_gate")


def dense_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Module path -> module of every dense Linear whose weight may be GGML blocks run by NativeLinear: outside the
    routed experts, not a router (KEEP_DENSE), not an output head tied to the embedding. `quantize --dense`
    encodes these; `weightstream import` keeps a GGUF's blocks for them."""
    experts = set(experts_modules(model))
    tied = ties_embeddings(model.config)
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or any(path.startswith(e + ".") for e in experts):
            continue
        if path.rpartition(".")[2] in KEEP_DENSE or (tied and module is model.get_output_embeddings()):
            continue
        out[path] = module
    return out


def dense_plan(mapped, bits: str) -> dict[str, tuple[str, tuple[int, int]]]:
    """Checkpoint tensor name -> (block type, (out, in)) for every Linear outside the experts that --dense
    quantizes."""
    plan = {}
    for path, module in dense_linears(mapped.model).items():
        n, k = module.out_features, module.in_features
        if f"{path}.weight" not in mapped.layout.dense or k % 32:
            continue
        wtype = DENSE_TYPES.get(bits) or ("Q4_K" if k % 256 == 0 else "Q4_1")
        plan[mapped.layout.dense[f"{path}.weight"].name] = (wtype, (n, k))  # by the name in the checkpoint
    return plan


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


def blob_format(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    transposed: bool,
    scheme: str,
    group: int | None,
    dtype: torch.dtype,
    source: dict,
) -> QuantFormat:
    """The blob table for experts with these parameters (name -> (shape, dtype), in execution order)."""
    shapes = {name: _out_in(shape, transposed) for name, (shape, _) in params.items() if len(shape) > 1}
    _check_shapes(shapes, scheme, group)
    entries = []
    act = torch_name(dtype)
    for name, (shape, _) in params.items():
        if len(shape) == 1:  # a bias: kept in the activation dtype
            entries.append((name, act, shape))
            continue
        n, k = shapes[name]
        if scheme in GGML_SCHEMES:  # scales live inside the blocks
            entries.append((f"{name}.qweight", GGML_SCHEMES[scheme][0], (n, k)))
        elif scheme == "int8":
            entries += [(f"{name}.qweight", "int8", (n, k)), (f"{name}.scales", act, (n,))]
        else:
            entries += [(f"{name}.qweight", "uint8", (n, k // 2)), (f"{name}.scales", act, (k // group, n, 2))]
    table, nbytes = blob_layout(entries)
    layout = torch_int4_layout() if scheme == "int4" else None
    return QuantFormat(scheme, act, table, nbytes, group if scheme == "int4" else None, layout, source)


MISS_FALLBACK = "Q4_0"  # a small copy's weight whose inputs are not whole super-blocks of 256: 4.5 bits, per 32


def miss_copy_format(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]], transposed: bool, bits: int, dtype: torch.dtype
) -> tuple[MissCopy, dict[str, str]]:
    """The small copies' table (`--miss-bits`): each weight as Q2_K (2) or Q3_K (3) where its inputs are whole
    super-blocks of 256, else as MISS_FALLBACK; biases in the activation dtype. Returns it and {weight: type} of the
    weights that fell back; refuses experts none of whose weights can be Q2_K / Q3_K."""
    if bits not in MISS_BITS:
        raise WeightstreamError(f"--miss-bits {bits}: choose 2 (Q2_K small copies) or 3 (Q3_K)")
    scheme = MISS_BITS[bits]
    wtype = GGML_SCHEMES[scheme][0]
    shapes = {name: _out_in(shape, transposed) for name, (shape, _) in params.items() if len(shape) > 1}
    if not any(k % BLOCK_TYPES[wtype].elements == 0 for _, k in shapes.values()):
        sizes = ", ".join(f"{name} {k}" for name, (_, k) in shapes.items())
        raise WeightstreamError(
            f"--miss-bits {bits}: {wtype} needs a weight's inputs in whole super-blocks of 256, and no expert weight "
            f"has them (inputs: {sizes}); small copies would save little here, quantize without --miss-bits"
        )
    entries, fallback = [], {}
    for name, (shape, _) in params.items():
        if len(shape) == 1:
            entries.append((name, torch_name(dtype), shape))
            continue
        n, k = shapes[name]
        t = wtype if k % BLOCK_TYPES[wtype].elements == 0 else MISS_FALLBACK
        if t != wtype:
            fallback[name] = t
        entries.append((f"{name}.qweight", t, (n, k)))
    table, nbytes = blob_layout(entries)
    return MissCopy(bits, scheme, table, nbytes), fallback


def _out_in(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    return (shape[1], shape[0]) if transposed else tuple(shape)  # stored (out, in): what the kernels take


def _fits(scheme: str, group: int | None, n: int, k: int) -> bool:
    if scheme in GGML_SCHEMES:
        return k % BLOCK_TYPES[GGML_SCHEMES[scheme][0]].elements == 0
    # torch's int8 kernel returns wrong values (no error) for bf16 inputs whose length is not a multiple of 16
    return k % 16 == 0 if scheme == "int8" else (k % group == 0 and n % 16 == 0)


def _check_shapes(shapes: dict[str, tuple[int, int]], scheme: str, group: int | None) -> None:
    """Refuse shapes the kernels cannot take, with a hint that is itself a command that works on every weight."""
    bad = next(((name, n, k) for name, (n, k) in shapes.items() if not _fits(scheme, group, n, k)), None)
    if bad is None:
        return
    name, n, k = bad
    if scheme in GGML_SCHEMES:
        block = BLOCK_TYPES[GGML_SCHEMES[scheme][0]].elements
        need = f"{n} x {k}; {scheme} needs inputs in whole blocks of {block}"
    elif scheme == "int8":
        need = f"{k} inputs; int8 experts need a multiple of 16"
    else:
        need = f"{n} x {k}; int4 with groups of {group} needs inputs divisible by the group and outputs by 16"
    if scheme in GGML_SCHEMES:
        torch_fits = scheme != "bf16" and all(k % 16 == 0 for _, k in shapes.values())
        works = ["--kernel torch"] if torch_fits else []
    else:
        groups = [g for g in INT4_GROUPS if all(_fits("int4", g, *s) for s in shapes.values())]
        works = [f"--bits 4 --group-size {max(groups)}"] if groups else []
        works += ["--bits 8"] if scheme != "int8" and all(_fits("int8", None, *s) for s in shapes.values()) else []
    if works:
        hint = f"use {' or '.join(works)}"
    elif scheme == "bf16":
        hint = "run the checkpoint as it is: eager bf16 needs no conversion"
    else:
        hint = "no int8 or int4 scheme fits these experts' shapes; keep them in their own precision"
    raise WeightstreamError(f"expert weight {name} is {need} ({hint})")


def quantize_expert(params: dict[str, torch.Tensor], transposed: bool, quant: QuantFormat) -> dict[str, torch.Tensor]:
    """One expert's tensors (model layout) -> the blob's tensors by name (kernel layout)."""
    out = {}
    for name, w in params.items():
        if w.dim() == 1:
            out[name] = w.to(quant.dtype)
            continue
        w = (w.t() if transposed else w).contiguous()  # (out, in), row-major as the kernels take it
        if quant.native:
            out[f"{name}.qweight"] = ENCODERS[quant.tensor(f"{name}.qweight").dtype](w)
        elif quant.scheme == "int8":
            out[f"{name}.qweight"], out[f"{name}.scales"] = quantize_int8(w, quant.dtype)
        else:
            q, out[f"{name}.scales"] = quantize_int4(w, quant.group_size, quant.dtype)
            out[f"{name}.qweight"] = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    return out


def expert_blob(tensors: dict[str, torch.Tensor], quant: QuantFormat) -> torch.Tensor:
    """The uint8 blob holding `tensors` at the manifest's offsets (zero padding between them)."""
    blob = torch.zeros(quant.blob_bytes, dtype=torch.uint8)
    for t in quant.tensors:
        data = tensors[t.name].contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == t.nbytes and tuple(tensors[t.name].shape) == t.storage[0], t.name
        blob[t.offset : t.offset + t.nbytes] = data
    return blob


def quantize_checkpoint(
    src: str,
    out: str,
    bits: int,
    group_size: int | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    kernel: str = "auto",
    dense: str = "keep",
    miss_bits: int | None = None,
) -> QuantizeResult:
    """Write `out`: `src` with every routed expert quantized to `bits`.

    `kernel` decides the format: `native` stores GGML blocks the native kernels run (8 bits: Q8_0; 4 bits: Q4_K,
    or Q4_1 where an input size is not whole super-blocks of 256; 16 bits: BF16, the weights as bfloat16, not
    quantized); `torch` stores torch's packed layouts (8 bits: one scale per output channel; 4 bits: groups of
    `group_size`); `auto` is native where the native kernels are built and no `group_size` is given, else torch.
    `dense` (`keep`, `int8`, `int4`, `bf16`) stores the dense linear weights too (attention, shared experts, dense
    MLPs, an untied output head; not the router, norms or embeddings) in the same block formats, for the native
    kernels."""
    start = time.perf_counter()
    if bits not in (8, 4, 16):
        raise WeightstreamError(f"--bits {bits}: choose 8, 4 or 16")
    if bits == 16 and (kernel == "torch" or group_size is not None):
        raise WeightstreamError("--bits 16 stores bf16 experts for the native kernels; drop --kernel torch")
    if bits == 16 and not native.available():
        raise WeightstreamError(f"--bits 16: the native kernels are not available here ({native.why_not()})")
    if kernel not in KERNELS:
        raise WeightstreamError(f"--kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "native" and group_size is not None:
        raise WeightstreamError(
            "--group-size is for --kernel torch; the native kernels use blocks of 32 (docs/kernels.md)"
        )
    if dense not in DENSE_CHOICES:
        raise WeightstreamError(f"--dense {dense!r}: choose one of {', '.join(DENSE_CHOICES)}")
    if dense != "keep" and (kernel == "torch" or group_size is not None):
        raise WeightstreamError(f"--dense {dense}: dense weights run on the native kernels only; drop --kernel torch")
    if dense != "keep" and not native.available():
        raise WeightstreamError(f"--dense {dense}: the native kernels are not available here ({native.why_not()})")
    if kernel == "native" and not native.available():
        raise WeightstreamError(f"--kernel native: the native kernels are not available here ({native.why_not()})")
    if miss_bits is not None and miss_bits not in MISS_BITS:
        raise WeightstreamError(f"--miss-bits {miss_bits}: choose 2 (Q2_K small copies) or 3 (Q3_K)")
    if miss_bits is not None and (kernel == "torch" or group_size is not None):
        raise WeightstreamError(
            f"--miss-bits {miss_bits}: small copies are GGML blocks (Q2_K / Q3_K) computed by the native kernels, "
            "beside native blobs; drop --kernel torch and --group-size"
        )
    if miss_bits is not None and not native.available():
        raise WeightstreamError(
            f"--miss-bits {miss_bits}: the native kernels are not available here ({native.why_not()})"
        )
    use_torch = kernel == "torch" or group_size is not None or (kernel == "auto" and not native.available())
    scheme = ("int8" if bits == 8 else "int4") if use_torch else {8: "q8_0", 16: "bf16"}.get(bits)
    group = DEFAULT_GROUP if group_size is None else group_size
    if scheme == "int4" and group not in INT4_GROUPS:
        raise WeightstreamError(
            f"--group-size {group}: torch's int4 kernel takes {', '.join(map(str, INT4_GROUPS))} "
            f"(leave it out for {DEFAULT_GROUP}; docs/quantization.md, 'Choosing the group size')"
        )
    if bits == 8 and group_size is not None:
        raise WeightstreamError("--group-size is for --bits 4; int8 experts have one scale per output channel")
    refuse_existing(out, force, sources=[src])
    mapped = map_model(src, convert=False)  # a published FP8 / MXFP4 source is read as published, expert by expert
    if mapped.quant is not None:
        also = " (with --miss-bits there, for small copies)" if miss_bits is not None else ""
        raise WeightstreamError(
            f"{src}: already quantized ({mapped.quant.scheme}); quantize the original checkpoint{also}"
        )
    modules = experts_modules(mapped.model)
    layout = mapped.layout
    first = layout.experts[next(iter(layout.experts))]
    transposed = next(iter(modules.values())).is_transposed
    params = {p.name: (p.shape, p.dtype) for p in first.params}
    published = mapped.published
    if (
        scheme is None
        and published is not None
        and all(published.holds_mxfp4(p) for p in first.params if len(p.shape) > 1)
    ):
        scheme = "mxfp4"  # native 4-bit from MXFP4 experts: their own blocks, kept (re-quantizing rounds twice)
    if scheme is None:  # native 4-bit: Q4_K where every input size is whole super-blocks of 256, else Q4_1
        inputs = [_out_in(shape, transposed)[1] for shape, _ in params.values() if len(shape) > 1]
        scheme = "q4_k" if all(k % 256 == 0 for k in inputs) else "q4_1"
    source = {
        "model_type": layout.model_type,
        "dtype": str(mapped.model.dtype).removeprefix("torch."),
        "expert_bytes": first.nbytes,
    }
    if published is not None:
        source["published"] = published.stamp()  # what a converted copy was made from (store/convert.py)
    quant = blob_format(params, transposed, scheme, group, mapped.model.dtype, source)
    if dense != "keep":
        quant = dataclasses.replace(quant, dense=dense_plan(mapped, dense))
    fallback = None
    if miss_bits is not None:
        miss, fallback = miss_copy_format(params, transposed, miss_bits, mapped.model.dtype)
        quant = dataclasses.replace(quant, miss_copy=miss)
    with built_in_place(out, "quantize") as tmp:
        total = _write(mapped, modules, quant, transposed, tmp, progress)
        _copy_side_files(src, tmp)
        if published is not None:
            strip_quantization_config(os.path.join(tmp, "config.json"))
        write_manifest(tmp, quant)  # last: without it the directory is not a quantized checkpoint
    return QuantizeResult(
        out,
        scheme,
        quant.group_size,
        len(layout.experts),
        published.stored_nbytes(first) if published is not None else first.nbytes,
        quant.blob_bytes,
        total,
        time.perf_counter() - start,
        miss_bits,
        quant.miss_copy.blob_bytes if quant.miss_copy else None,
        fallback,
    )


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
