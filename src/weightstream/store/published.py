"""Checkpoints as FP8 and MXFP4 models are published, read tensor by tensor and run through a converted copy.

Two layouts, recognised from config.json's `quantization_config` and checked against the tensors present:

- **FP8 with block scales** (`quant_method: fp8`, DeepSeek-V3, the Qwen3 FP8 releases): each quantized linear
  weight (out, in) is float8_e4m3fn beside `<name>_scale_inv`, float32 (ceil(out / bo), ceil(in / bi)) for
  `weight_block_size` [bo, bi]: w = e4m3 value x the scale of its block, the last blocks partial where a size is
  not a multiple of the block. Norms, embeddings, routers (and `modules_to_not_convert`) stay as they are.
- **MXFP4** (`quant_method: mxfp4`, gpt-oss): the experts' `gate_up_proj_blocks` (E, 2I, H / 32, 16) uint8, two
  E2M1 codes a byte (the even element in the low nibble), with `gate_up_proj_scales` (E, 2I, H / 32) uint8, E8M0
  exponents (2^(s - 127)) of each 32 inputs; the same for `down_proj`. Row r of the blocks is output r of the
  projection, as transformers' GptOssExperts uses it (gate_up's gate and up rows interleaved).

`read_published` validates a checkpoint (every FP8 weight has scales of its blocks' shape, every MXFP4 block
tensor its scales) and gives a *logical* view of it: each quantized tensor appears under the name, shape and dtype
the model gives it, at a synthetic offset, so that `layout.build_layout` maps it like any other tensor; the readers
here turn an expert's (or a dense tensor's) pieces of that view back into values from the published bytes, one
expert or one tensor at a time. `weightstream quantize` reads a published source through them.

Running one as it is (`generate`, `serve`, `bench`, `tune`): `runnable_dir` converts the checkpoint once, expert
by expert, into a quantized-experts directory beside it (`MODEL/.weightstream/<fp8|mxfp4>-experts`, kept and reused
while the source files are unchanged, said on stderr at every load), which is what then runs:

- MXFP4 experts become GGML's MXFP4 blocks (native.BLOCK_TYPES["MXFP4"]), losslessly: the same E8M0 byte
  (GGML's half-scale convention doubles the E2M1 values instead) before 16 bytes whose nibbles are reordered
  (element j low, j + 16 high); the native MXFP4 kernel runs them, and a miss reads as many bytes as published.
- FP8 experts become BF16 rows (the weights exactly as dequantized: each product rounded to bf16 once, as
  transformers dequantizes them), run by the native kernels; dense FP8 weights are dequantized to the model's
  dtype (bf16) once, in the copy.

Why a converted copy and not the stored bytes decoded at each use: every cache miss then stays one O_DIRECT read
of a blob already in its kernel's layout, nothing repacked per miss (docs/quantization.md, "On disk"), and the
engine, cache, simulator and tune need nothing new. For MXFP4 that costs disk (one more copy of the experts) and no
bytes per miss; FP8 has no row kernel among the native ones (csrc/), so its experts read twice the published bytes
per miss: `weightstream quantize MODEL --bits 8` writes Q8_0 experts of about the published size instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import Checkpoint, read_bytes, read_tensor
from weightstream.store.dtypes import FLOATS, TABLE, safetensors_name, torch_dtype, weights_dtype
from weightstream.store.safetensors_index import TensorInfo

FP8_DTYPES = {name: getattr(torch, TABLE[name][0]) for name in ("F8_E4M3", "F8_E5M2")}  # store.dtypes' names
FP8_FORMATS = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}
SCALE_DTYPES = ("F32", "BF16", "F16")
SCALE_SUFFIX = "_scale_inv"
BLOCKS, SCALES = "_blocks", "_scales"
SYNTHETIC = 1 << 40  # logical tensors sit at multiples of this, past any real offset (a shard is far below 1 TiB)
# the E2M1 values of the 16 codes (OCP MX spec; transformers' FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
METHODS = ("fp8", "mxfp4")


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """One published quantized tensor: its stored weight (FP8 values or MXFP4 blocks), its scales, and the tensor
    the model sees (`logical`: name, shape, the model's dtype, at a synthetic offset)."""

    kind: str  # "fp8" or "mxfp4"
    weight: TensorInfo
    scale: TensorInfo
    logical: TensorInfo


@dataclass(slots=True)
class Published:
    """A published FP8 or MXFP4 checkpoint, validated, with its logical view."""

    kind: str  # "fp8" or "mxfp4"
    source: Checkpoint
    checkpoint: Checkpoint  # the logical view: quantized tensors by the model's name, scales gone
    dtype: torch.dtype  # the dtype of its unquantized floats: the model is built and computes in it
    block: tuple[int, int] | None  # FP8: weight_block_size
    quantized: dict[int, QuantizedTensor]  # by synthetic offset

    @property
    def model_dir(self) -> str:
        return self.source.model_dir

    def describe(self) -> str:
        if self.kind == "fp8":
            return f"FP8 with {self.block[0]}x{self.block[1]} block scales"
        return "MXFP4 experts"

    def stamp(self) -> dict:
        """What the converted copy was made from: each source file's size and modification time."""
        files = sorted({t.path for t in self.source.tensors.values()} | {os.path.join(self.model_dir, "config.json")})
        return {"format": self.kind, "files": {os.path.basename(p): _identity(p) for p in files}}

    def _at(self, offset: int) -> tuple[QuantizedTensor | None, int]:
        q = self.quantized.get(offset // SYNTHETIC * SYNTHETIC) if offset >= SYNTHETIC else None
        return q, (offset - q.logical.offset if q is not None else 0)

    def read_tensor(self, info: TensorInfo, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A whole tensor of the logical view: a quantized one dequantized into `dtype` (default the model's), any
        other as stored."""
        q, _ = self._at(info.offset)
        if q is None:
            return read_bytes(info.path, info.offset, info.nbytes).view(torch_dtype(info.dtype)).reshape(info.shape)
        return self._dequantize(q, None, dtype or self.dtype)

    def read_param(self, param) -> torch.Tensor:
        """One expert's parameter (a layout.ExpertParam of the logical view) in the model's layout, float32."""
        parts = []  # each piece flat; one expert's tensor concatenated in the order the layout lists them
        for piece in param.pieces:
            q, rel = self._at(piece.offset)
            if q is None:
                raw = read_bytes(piece.path, piece.offset, piece.nbytes).view(param.dtype)
                parts.append(raw.float().reshape(-1))
            elif piece.nbytes == q.logical.nbytes:  # the whole tensor: one expert's own (per-expert keys)
                parts.append(self._dequantize(q, None, torch.float32).reshape(-1))
            else:  # expert `rel // nbytes` of a fused tensor (E, ...)
                parts.append(self._dequantize(q, rel // piece.nbytes, torch.float32).reshape(-1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(param.shape)

    def stored_nbytes(self, expert) -> int:
        """Bytes of one expert (a layout.ExpertLayout of the logical view) as published: values or blocks with their
        scales."""
        total = 0
        for piece in (piece for param in expert.params for piece in param.pieces):
            q, _ = self._at(piece.offset)
            stored = piece.nbytes if q is None else (q.weight.nbytes + q.scale.nbytes) * piece.nbytes
            total += stored if q is None else stored // q.logical.nbytes
        return total

    def holds_mxfp4(self, param) -> bool:
        """Whether an expert's parameter is its slice of published MXFP4 blocks."""
        q = self._at(param.pieces[0].offset)[0] if len(param.pieces) == 1 else None
        return q is not None and q.kind == "mxfp4"

    def mxfp4_rows(self, param) -> torch.Tensor:
        """One expert's projection (`holds_mxfp4`) as GGML MXFP4 rows (out, in / 32 * 17 bytes), from its published
        blocks without rounding anything."""
        q, rel = self._at(param.pieces[0].offset)
        return ggml_mxfp4_rows(*self._mxfp4_expert(q, rel // param.pieces[0].nbytes))

    def _dequantize(self, q: QuantizedTensor, expert: int | None, dtype: torch.dtype) -> torch.Tensor:
        if q.kind == "fp8":
            return dequantize_fp8(self._fp8_values(q.weight), read_tensor(q.scale), self.block, dtype)
        if expert is not None:
            return dequantize_mxfp4(*self._mxfp4_expert(q, expert)).t().to(dtype)  # (in, out) as the model keeps it
        experts = [dequantize_mxfp4(*self._mxfp4_expert(q, e)).t().to(dtype) for e in range(q.weight.shape[0])]
        return torch.stack(experts)

    @staticmethod
    def _fp8_values(info: TensorInfo) -> torch.Tensor:
        return read_bytes(info.path, info.offset, info.nbytes).view(FP8_DTYPES[info.dtype]).reshape(info.shape)

    @staticmethod
    def _mxfp4_expert(q: QuantizedTensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's blocks (rows, groups, 16) and scales (rows, groups), read from the published tensors."""
        experts = q.weight.shape[0]
        b, s = q.weight.nbytes // experts, q.scale.nbytes // experts
        blocks = read_bytes(q.weight.path, q.weight.offset + e * b, b).reshape(q.weight.shape[1:])
        scales = read_bytes(q.scale.path, q.scale.offset + e * s, s).reshape(q.scale.shape[1:])
        return blocks, scales


def dequantize_fp8(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w = value x scale of its block, each product in float32 rounded once to `dtype` (as transformers' FP8
    dequantization rounds it); whole rows of blocks at a time, about FP8_CHUNK weights, so a big tensor never has a
    float32 copy of its own."""
    n, k = values.shape
    bo = block[0]
    scale_inv = scale_inv.float()
    step = bo * max(1, FP8_CHUNK // (bo * k))
    if step >= n and dtype == torch.float32:
        return _scale_blocks(values.float(), scale_inv, block)
    out = torch.empty(n, k, dtype=dtype)
    for start in range(0, n, step):
        out[start : start + step] = _scale_blocks(values[start : start + step].float(), scale_inv[start // bo :], block)
    return out


FP8_CHUNK = 1 << 22


def _scale_blocks(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x (rows from a block boundary) times its blocks' scales `s`, in place: the whole blocks in one product, the
    partial last column and row of blocks in one each."""
    (m, k), (bo, bi) = x.shape, block
    rw, cw = m // bo, k // bi  # whole blocks down and across
    if rw and cw:
        x[: rw * bo, : cw * bi].view(rw, bo, cw, bi).mul_(s[:rw, None, :cw, None])
    if rw and cw * bi < k:
        x[: rw * bo, cw * bi :].view(rw, bo, k - cw * bi).mul_(s[:rw, cw, None, None])
    if rw * bo < m and cw:
        x[rw * bo :, : cw * bi].view(m - rw * bo, cw, bi).mul_(s[rw, None, :cw, None])
    if rw * bo < m and cw * bi < k:
        x[rw * bo :, cw * bi :].mul_(s[rw, cw])
    return x


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(rows, groups, 16) blocks and (rows, groups) E8M0 scales -> float32 (rows, groups * 32): element 2j of a
    group is the low nibble of byte j, 2j + 1 the high one, times 2^(scale - 127) (transformers'
    convert_moe_packed_tensors, in float32)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)  # (rows, groups, 32)
    values = torch.ldexp(lut[codes.long()], (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.reshape(blocks.shape[0], -1)


def ggml_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Published MXFP4 (rows, groups, 16) + (rows, groups) -> GGML MXFP4 rows (rows, groups * 17): per 32 weights
    the E8M0 byte as it is (GGML halves the scale and doubles the E2M1 values: the same weights) and 16 bytes with
    element j in the low nibble of byte j and j + 16 in the high one (llama.cpp's convert_hf_to_gguf does the same).
    Published byte m holds elements 2m and 2m + 1, byte 8 + m elements 16 + 2m and 17 + 2m, so GGML's byte 2m is
    their low nibbles and byte 2m + 1 their high ones. In numpy: uint8 work on one core, 10x torch's on a busy one."""
    b, s = blocks.numpy(), scales.numpy()
    low, high = b[..., :8], b[..., 8:]
    out = np.empty((*b.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = s
    np.bitwise_or(low & 15, high << 4, out=out[..., 1::2])
    np.bitwise_or(low >> 4, high & 0xF0, out=out[..., 2::2])
    return torch.from_numpy(out.reshape(b.shape[0], -1))


def read_published(ckpt: Checkpoint) -> Published | None:
    """The checkpoint as published FP8 / MXFP4, validated; None for a checkpoint without `quantization_config`.
    Every problem is a WeightstreamError naming the file and the tensor or key, raised before anything is written."""
    config_path = os.path.join(ckpt.model_dir, "config.json")
    qc = ckpt.config.get("quantization_config")
    if qc is None:
        fp8 = next((t for t in ckpt.tensors.values() if t.dtype in FP8_DTYPES), None)
        if fp8 is not None:
            raise WeightstreamError(
                f"{fp8.path}: tensor {fp8.name!r} is {fp8.dtype} but {config_path} has no quantization_config; "
                "an FP8 checkpoint names its format there (quant_method fp8, weight_block_size)"
            )
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in METHODS:
        raise WeightstreamError(
            f"{config_path}: quantization_config quant_method {method!r}: weightstream runs {' and '.join(METHODS)} "
            "checkpoints as published (DeepSeek-V3 / Qwen3 FP8 block scales, gpt-oss MXFP4); convert others to "
            "bf16 first"
        )
    if method == "fp8":
        return _read_fp8(ckpt, qc, config_path)
    return _read_mxfp4(ckpt, config_path)


def _read_fp8(ckpt: Checkpoint, qc: dict, config_path: str) -> Published:
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightstreamError(
            f"{config_path}: quantization_config weight_block_size is {block!r}; weightstream reads FP8 with block "
            "scales ([128, 128] in DeepSeek-V3 and the Qwen3 FP8 releases), not per-tensor or per-channel scales"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise WeightstreamError(
            f"{config_path}: quantization_config fmt {fmt!r}, activation_scheme "
            f"{qc.get('activation_scheme')!r}: weightstream reads {' or '.join(FP8_FORMATS)} weights with dynamic "
            "activations"
        )
    tensors = ckpt.tensors
    for name, info in tensors.items():
        if name.endswith(SCALE_SUFFIX) and tensors.get(name.removesuffix(SCALE_SUFFIX), info).dtype not in FP8_DTYPES:
            raise WeightstreamError(
                f"{info.path}: {name!r} scales {name.removesuffix(SCALE_SUFFIX)!r}, which is not an FP8 tensor of "
                "this checkpoint; the checkpoint is inconsistent"
            )
        if name.endswith(("activation_scale", "input_scale")):
            raise WeightstreamError(
                f"{info.path}: tensor {name!r} is a static activation scale; weightstream reads FP8 with dynamic "
                "activations (activation_scheme dynamic)"
            )
    quantized = []
    for name, info in tensors.items():
        if info.dtype not in FP8_DTYPES:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if len(info.shape) != 2:
            raise WeightstreamError(
                f"{info.path}: FP8 tensor {name!r} has shape {list(info.shape)}; weightstream reads 2-D FP8 weights "
                "(out, in) with 2-D block scales"
            )
        if scale is None:
            raise WeightstreamError(
                f"{info.path}: FP8 tensor {name!r} has no scales ({name + SCALE_SUFFIX!r} is missing from the "
                "checkpoint); without them its values mean nothing: re-download the checkpoint"
            )
        want = tuple(math.ceil(d / b) for d, b in zip(info.shape, block))
        if tuple(scale.shape) != want or scale.dtype not in SCALE_DTYPES:
            raise WeightstreamError(
                f"{scale.path}: scales {scale.name!r} are {scale.dtype}{list(scale.shape)}; FP8 weight {name!r} "
                f"{list(info.shape)} in blocks of {block} needs float {list(want)}"
            )
        quantized.append(("fp8", info, scale, info.shape))
    return _published(ckpt, "fp8", tuple(block), quantized, {n for n in tensors if n.endswith(SCALE_SUFFIX)})


def _read_mxfp4(ckpt: Checkpoint, config_path: str) -> Published:
    tensors = ckpt.tensors
    quantized = []
    for name, info in tensors.items():
        if name.endswith(SCALES) and name.removesuffix(SCALES) + BLOCKS not in tensors:
            raise WeightstreamError(
                f"{info.path}: {name!r} has no {name.removesuffix(SCALES) + BLOCKS!r} to scale; the checkpoint is "
                "inconsistent"
            )
        if not name.endswith(BLOCKS):
            continue
        scale = tensors.get(name.removesuffix(BLOCKS) + SCALES)
        if info.dtype != "U8" or len(info.shape) != 4 or info.shape[-1] != 16:
            raise WeightstreamError(
                f"{info.path}: MXFP4 tensor {name!r} is {info.dtype}{list(info.shape)}; gpt-oss stores experts' blocks "
                "as U8 (experts, rows, inputs / 32, 16)"
            )
        if scale is None:
            raise WeightstreamError(
                f"{info.path}: MXFP4 tensor {name!r} has no scales ({name.removesuffix(BLOCKS) + SCALES!r} is "
                "missing from the checkpoint); re-download the checkpoint"
            )
        if scale.dtype != "U8" or tuple(scale.shape) != tuple(info.shape[:-1]):
            raise WeightstreamError(
                f"{scale.path}: scales {scale.name!r} are {scale.dtype}{list(scale.shape)}; MXFP4 blocks {name!r} "
                f"{list(info.shape)} need U8{list(info.shape[:-1])} (one E8M0 exponent per 32 inputs)"
            )
        experts, rows, groups, _ = info.shape
        quantized.append(("mxfp4", info, scale, (experts, groups * 32, rows)))  # the model's (E, in, out)
    if not quantized:
        raise WeightstreamError(
            f"{config_path}: quantization_config says mxfp4 but no tensor ends in {BLOCKS}; the checkpoint and its "
            "config disagree"
        )
    return _published(ckpt, "mxfp4", None, quantized, {n for n in tensors if n.endswith(SCALES)})


def _published(ckpt: Checkpoint, kind: str, block, quantized: list, scales: set[str]) -> Published:
    stored = {q[1].name for q in quantized} | scales
    floats = weights_dtype(t for name, t in ckpt.tensors.items() if name not in stored and t.dtype in FLOATS)
    dtype = torch_dtype(floats) if floats else torch.bfloat16
    itemsize = torch.empty((), dtype=dtype).element_size()
    logical = {n: t for n, t in ckpt.tensors.items() if n not in stored}
    by_offset = {}
    for i, (q_kind, weight, scale, shape) in enumerate(quantized):
        name = weight.name.removesuffix(BLOCKS) if q_kind == "mxfp4" else weight.name
        offset = SYNTHETIC * (i + 1)
        info = TensorInfo(name, weight.path, offset, math.prod(shape) * itemsize, safetensors_name(dtype), shape)
        logical[name] = info
        by_offset[offset] = QuantizedTensor(q_kind, weight, scale, info)
    view = Checkpoint(ckpt.model_dir, ckpt.config, logical)
    return Published(kind, ckpt, view, dtype, block, by_offset)


def copy_path(published: Published) -> str:
    """Where the converted copy of a published checkpoint lives (store/convert.py writes it): beside it."""
    return os.path.join(published.model_dir, ".weightstream", f"{published.kind}-experts")


def fresh_copy(published: Published) -> str | None:
    """The converted copy of `published` when one is there and was made from its files as they are now, else None.
    Reads only."""
    from weightstream.store.quant.manifest import read_manifest

    out = copy_path(published)
    try:
        fmt = read_manifest(out) if os.path.isdir(out) else None
    except WeightstreamError:
        return None  # damaged: convert.py writes it again
    return out if fmt is not None and (fmt.source or {}).get("published") == published.stamp() else None


def _identity(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def strip_quantization_config(config_path: str) -> None:
    """config.json without `quantization_config`: a converted copy is no longer the published format."""
    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
