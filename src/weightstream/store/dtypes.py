"""The one table of tensor dtypes: safetensors' names (`BF16`), torch's names (`bfloat16`, what manifests and
config.json say), bytes per element, and torch dtypes.

Importing it does not import torch, so the header parser (`safetensors_index`) and routing traces' shapes stay
torch-free; the functions that give torch dtypes import it.
"""

from __future__ import annotations

import functools

# safetensors header name -> (torch's name, bytes per element): every dtype a safetensors header may carry
TABLE = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}
# the dtypes weightstream reads or writes as torch tensors (`torch_dtype`); the others are only indexed, or read as
# bytes (a published checkpoint's FP8 and scales)
TORCH = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
FLOATS = ("F64", "F32", "F16", "BF16")  # checkpoint dtypes a model can be built and streamed in
ELEMENT_BYTES = {name: nbytes for name, (_, nbytes) in TABLE.items()}  # by safetensors' name
TORCH_NAME_BYTES = {torch: nbytes for torch, nbytes in TABLE.values()}  # by torch's name
_BY_TORCH_NAME = {torch: name for name, (torch, _) in TABLE.items() if name in TORCH}


@functools.cache
def _torch_dtypes() -> dict:
    import torch

    return {name: getattr(torch, TABLE[name][0]) for name in TORCH}


def torch_dtype(name: str):
    """ "BF16" -> torch.bfloat16 (KeyError for a name that is not one of TORCH)."""
    return _torch_dtypes()[name]


def safetensors_name(dtype) -> str:
    """torch.bfloat16 -> "BF16" (KeyError for a dtype that is not one of TORCH's)."""
    try:
        return _BY_TORCH_NAME[torch_name(dtype)]
    except KeyError:
        raise KeyError(dtype) from None


def torch_name(dtype) -> str:
    """`torch.bfloat16` -> "bfloat16": the name manifests store."""
    return str(dtype).removeprefix("torch.")


def from_torch_name(name: str):
    """ "bfloat16" -> torch.bfloat16 (KeyError for a name that is not one of TORCH's dtypes)."""
    if name not in _BY_TORCH_NAME:
        raise KeyError(name)
    return torch_dtype(_BY_TORCH_NAME[name])


def weights_dtype(tensors) -> str | None:
    """The safetensors dtype most of `tensors`' bytes are in (any objects with `dtype` and `nbytes`, a checkpoint's
    `TensorInfo`s), None for none: the one rule for a checkpoint's dtype, which the model is built in so that its
    bytes are used as they are (`store.model.checkpoint_dtype`, a published checkpoint's logical view) and routing
    traces' shapes size experts in (`trace.shapes`)."""
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
    return max(counts, key=counts.get) if counts else None
