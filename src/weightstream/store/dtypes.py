"""The one table of tensor dtypes: safetensors' names (`BF16`), torch's names (`bfloat16`) and torch dtypes."""

from __future__ import annotations

import torch

# safetensors header name -> torch dtype, for every dtype weightstream reads or writes
SAFETENSORS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS.items()}
FLOATS = ("F64", "F32", "F16", "BF16")  # checkpoint dtypes a model can be built and streamed in


def torch_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16": the name manifests store."""
    return str(dtype).removeprefix("torch.")


def from_torch_name(name: str) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16 (KeyError for a name that is not one of SAFETENSORS' dtypes)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_NAMES:
        raise KeyError(name)
    return dtype
