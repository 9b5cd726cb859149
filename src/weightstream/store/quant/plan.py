"""What a quantized expert's blob holds, and which dense weights are quantized beside it.

The plan of a quantization, before anything is read: the blob table for experts of given shapes (`blob_format`),
the small copies' table (`miss_copy_format`), the shapes the kernels refuse (with a hint that works), the dense
linears `--dense` encodes (`dense_linears`, `dense_plan`: `weightstream import` keeps a GGUF's blocks for the same
set); and one expert's tensors turned into its blob (`quantize_expert`, `expert_blob`), which the pipeline, the
importer and the engine's load-time kernel check share.
"""

from __future__ import annotations

import torch

from weightstream.errors import WeightstreamError
from weightstream.store.dtypes import torch_name
from weightstream.store.facts import ties_embeddings
from weightstream.store.layout import experts_modules
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.manifest import BLOCK_TYPES, GGML_SCHEMES, MISS_BITS, MissCopy, QuantFormat, blob_layout
from weightstream.store.quant.torch_codes import INT4_GROUPS, quantize_int4, quantize_int8, torch_int4_layout

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


def blob_format(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    transposed: bool,
    scheme: str,
    group: int | None,
    dtype: torch.dtype,
    source: dict,
) -> QuantFormat:
    """The blob table for experts with these parameters (name -> (shape, dtype), in execution order)."""
    shapes = {name: out_in(shape, transposed) for name, (shape, _) in params.items() if len(shape) > 1}
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
    shapes = {name: out_in(shape, transposed) for name, (shape, _) in params.items() if len(shape) > 1}
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


def out_in(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
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
