"""The quantized-experts format: a checkpoint directory whose experts are one packed blob each, plus a manifest.

Dense weights (attention, norms, router, embeddings, shared experts) are stored as in any checkpoint. Each routed
expert is one uint8 tensor `<experts module>.<expert>.packed`: its tensors back to back in execution order (gate
and up first, down last, biases after their projection), each 64-byte aligned inside the blob and already in the
layout the kernel takes, with its scales (and zeros) beside it. A miss is then one O_DIRECT request straight into
the slot, and nothing is repacked. The manifest (MANIFEST in the directory) names the scheme and lists the blob's
tensors; `weightstream quantize` writes it last, so a directory without it is not a quantized checkpoint.

`quantize --miss-bits 2|3` adds beside each blob a small copy of the same expert, `<experts module>.<expert>.small`
(its weights as Q2_K or Q3_K, in shard files of their own, one per decoder layer), laid out as blobs are; the
manifest's `miss_copy` lists its table. `--miss-copy` reads it on a cache miss (docs/quantization.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

import torch

from weightstream.errors import WeightstreamError
from weightstream.native import BLOCK_TYPES, row_bytes
from weightstream.store.dtypes import from_torch_name
from weightstream.store.facts import KV_B_HALVES
from weightstream.store.quant.torch_codes import INT4_GROUPS, INT4_LAYOUTS

MANIFEST = "weightstream-quantized.json"
FORMAT = "weightstream-quantized-experts"
# version 1: torch's packed-weight schemes; version 2 adds GGML block schemes for the native kernels; version 3 adds
# the small copies `--miss-bits` writes (written only then: a reader that knows no small copies refuses the directory
# instead of taking them for dense tensors)
VERSION = 2
MISS_COPY_VERSION = 3
# version 4: DeepSeek's k_b and v_b kept as the GGUF's blocks apart (store/facts.py KV_B_HALVES), where the model has
# one kv_b_proj (written only then: a reader that knows no such tensors refuses the directory)
KV_B_VERSION = 4
VERSIONS = (1, 2, 3, 4)
TORCH_SCHEMES = ("int8", "int4")
# GGML block schemes (native.py) -> the block types a weight may be stored in, the one `quantize` writes first
# (an import keeps each tensor's own type: a Q4_K_M file stores some projections as Q6_K, a Q2_K file mixes
# Q2_K/Q3_K/Q4_K, gpt-oss's experts are MXFP4)
GGML_SCHEMES = {
    "q8_0": ("Q8_0",),
    "q4_1": ("Q4_1", "Q4_0", "Q8_0"),
    "q4_k": ("Q4_K", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"),
    "bf16": ("BF16",),  # not quantized: bf16 weights on the native kernels (float32 activations)
    "mxfp4": ("MXFP4",),  # a published MXFP4 checkpoint's experts, their blocks kept (store/published.py)
    # the small copies of `--miss-bits 2|3` (`MissCopy`): Q2_K / Q3_K, Q4_0 for a weight whose inputs are not whole
    # super-blocks of 256
    "q2_k": ("Q2_K", "Q4_0"),
    "q3_k": ("Q3_K", "Q4_0"),
}
MISS_BITS = {2: "q2_k", 3: "q3_k"}  # --miss-bits -> the small copies' scheme
SCHEMES = (*TORCH_SCHEMES, *GGML_SCHEMES)
BLOB_ALIGN = 64
# the dtypes a blob's tensors may have (names as torch spells them); GGML block types (rows of blocks) are
# native.BLOCK_TYPES
DTYPES = {name: from_torch_name(name) for name in ("bfloat16", "float16", "float32", "int8", "uint8")}


@dataclass(frozen=True, slots=True)
class BlobTensor:
    """One tensor inside an expert's blob: byte offset from the blob's start, dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        if self.dtype in BLOCK_TYPES:  # (rows, inputs) of whole blocks
            return self.shape[0] * row_bytes(self.dtype, self.shape[1])
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def storage(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the tensor as it lies in the slot (a block type's rows are uint8 bytes)."""
        if self.dtype in BLOCK_TYPES:
            return (self.shape[0], self.nbytes // self.shape[0]), torch.uint8
        return self.shape, DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class MissCopy:
    """The small copy of every expert that `quantize --miss-bits` writes beside its blob: its bits, scheme and table
    (the blob's tensors, by the same names, in the small copy's block types) and its bytes."""

    bits: int
    scheme: str
    tensors: tuple[BlobTensor, ...]
    blob_bytes: int

    def to_json(self) -> dict:
        return {
            "bits": self.bits,
            "scheme": self.scheme,
            "tensors": _table_json(self.tensors),
            "blob_bytes": self.blob_bytes,
        }


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """What MANIFEST says: the scheme, its parameters, and the table of every expert blob's tensors."""

    scheme: str
    activation_dtype: str  # the dtype the model computes in (the source checkpoint's), scales included
    tensors: tuple[BlobTensor, ...]
    blob_bytes: int
    group_size: int | None = None  # int4
    int4_layout: str | None = None  # int4: the CPU layout of the packed bytes
    source: dict | None = None  # what it was made from (model type, dtype, bytes of one expert)
    # decoder layer -> (its own table, its blob bytes), where a layer's experts differ from `tensors` (a GGUF
    # import keeps each tensor's type, and Q4_K_M files store some layers' down projections as Q6_K)
    layer_tables: dict[int, tuple[tuple[BlobTensor, ...], int]] | None = None
    # dense weights stored as GGML blocks too (`quantize --dense`): parameter name -> its block type and
    # logical (out, in) shape; the checkpoint holds them as uint8 (out, row bytes), run by native.py
    dense: dict[str, tuple[str, tuple[int, int]]] | None = None
    # `quantize --miss-bits`: a small copy of every expert beside its blob (None: no small copies)
    miss_copy: MissCopy | None = None

    def table(self, layer: int) -> tuple[tuple[BlobTensor, ...], int]:
        """The blob table and blob bytes of the experts of decoder layer `layer`."""
        return (self.layer_tables or {}).get(layer, (self.tensors, self.blob_bytes))

    def tables(self) -> list[tuple[tuple[BlobTensor, ...], int]]:
        return [(self.tensors, self.blob_bytes), *(self.layer_tables or {}).values()]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.activation_dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the engine builds the model in: float32 where the dense linear weights are GGML blocks (the
        native kernels take and return float32, so the activations stay float32 between them and no op converts;
        norms and routers are made float32 at load, an untied input embedding stays as stored), else the
        activation dtype."""
        return torch.float32 if self.native and self.dense else self.dtype

    def tensor(self, name: str) -> BlobTensor:
        return next(t for t in self.tensors if t.name == name)

    def miss_format(self) -> QuantFormat:
        """The small copies' format, as a QuantFormat the kernels and encoders take: their scheme and table, no
        per-layer tables, no small copies of their own."""
        assert self.miss_copy is not None
        m = self.miss_copy
        return replace(
            self, scheme=m.scheme, tensors=m.tensors, blob_bytes=m.blob_bytes, layer_tables=None, miss_copy=None
        )

    @property
    def native(self) -> bool:
        """Whether the experts are GGML blocks the native kernels run (else torch's packed layouts)."""
        return self.scheme in GGML_SCHEMES

    def to_json(self) -> dict:
        version = (MISS_COPY_VERSION if self.miss_copy else VERSION) if self.native else 1
        if any(key.endswith(f"{KV_B_HALVES[0]}.weight") for key in self.dense or ()):
            version = max(version, KV_B_VERSION)
        out = {"format": FORMAT, "version": version, **asdict(self)}
        out["tensors"] = _table_json(self.tensors)
        if self.layer_tables:
            out["layer_tables"] = {
                str(layer): {"tensors": _table_json(table), "blob_bytes": nbytes}
                for layer, (table, nbytes) in sorted(self.layer_tables.items())
            }
        else:
            out.pop("layer_tables")
        if self.dense:
            out["dense"] = {name: {"dtype": t, "shape": list(shape)} for name, (t, shape) in sorted(self.dense.items())}
        else:
            out.pop("dense")
        if self.miss_copy:
            out["miss_copy"] = self.miss_copy.to_json()
        else:
            out.pop("miss_copy")
        return out


def _table_json(table: tuple[BlobTensor, ...]) -> list[dict]:
    return [{**asdict(t), "shape": list(t.shape)} for t in table]


def _table(items: list[dict]) -> tuple[BlobTensor, ...]:
    return tuple(BlobTensor(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]), int(t["offset"])) for t in items)


def blob_key(module_path: str, expert: int) -> str:
    """The checkpoint key of one expert's blob."""
    return f"{module_path}.{expert}.packed"


def small_key(module_path: str, expert: int) -> str:
    """The checkpoint key of one expert's small copy (`quantize --miss-bits`)."""
    return f"{module_path}.{expert}.small"


def blob_layout(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[BlobTensor, ...], int]:
    """Offsets for (name, dtype, shape) entries in order, each aligned to BLOB_ALIGN; returns (table, blob bytes)."""
    table, offset = [], 0
    for name, dtype, shape in entries:
        tensor = BlobTensor(name, dtype, tuple(shape), offset)
        table.append(tensor)
        offset = -(-(offset + tensor.nbytes) // BLOB_ALIGN) * BLOB_ALIGN
    return tuple(table), offset


def read_manifest(model_dir: str) -> QuantFormat | None:
    """The directory's quantization manifest, validated; None when it has none (not a quantized checkpoint)."""
    path = os.path.join(model_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        fmt = _parse(data)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise WeightstreamError(
            f"{path}: damaged quantization manifest ({type(exc).__name__}: {exc}); "
            "re-run `weightstream quantize` to rebuild the directory"
        ) from None
    _validate(fmt, path)
    return fmt


def write_manifest(model_dir: str, fmt: QuantFormat) -> None:
    with open(os.path.join(model_dir, MANIFEST), "w") as f:
        json.dump(fmt.to_json(), f, indent=1)
        f.write("\n")


def _parse(data: dict) -> QuantFormat:
    if data.get("format") != FORMAT or data.get("version") not in VERSIONS:
        raise ValueError(
            f"format {data.get('format')!r} version {data.get('version')!r}, expected {FORMAT!r} version "
            f"{' or '.join(map(str, VERSIONS))}"
        )
    tensors = _table(data["tensors"])
    layers = {int(k): (_table(v["tensors"]), int(v["blob_bytes"])) for k, v in data.get("layer_tables", {}).items()}
    miss = data.get("miss_copy")
    if miss is not None:
        miss = MissCopy(int(miss["bits"]), miss["scheme"], _table(miss["tensors"]), int(miss["blob_bytes"]))
    return QuantFormat(
        data["scheme"],
        data["activation_dtype"],
        tensors,
        int(data["blob_bytes"]),
        data.get("group_size"),
        data.get("int4_layout"),
        data.get("source"),
        layers or None,
        {name: (d["dtype"], tuple(int(x) for x in d["shape"])) for name, d in data.get("dense", {}).items()} or None,
        miss,
    )


def _validate(fmt: QuantFormat, path: str) -> None:
    """The table must be one the kernels can take: known dtypes, scales shaped for their weights, inside the blob."""

    def bad(what: str) -> WeightstreamError:
        return WeightstreamError(
            f"{path}: {what}; the manifest does not match a quantized checkpoint (re-run `weightstream quantize`)"
        )

    if fmt.scheme not in SCHEMES or fmt.activation_dtype not in ("bfloat16", "float16", "float32"):
        raise bad(f"scheme {fmt.scheme!r} / activation dtype {fmt.activation_dtype!r} unknown")
    if fmt.scheme == "int4" and (fmt.group_size not in INT4_GROUPS or fmt.int4_layout not in INT4_LAYOUTS):
        raise bad(f"int4 needs group_size in {INT4_GROUPS} and int4_layout in {tuple(INT4_LAYOUTS)}")
    tables = [(table, nbytes, GGML_SCHEMES.get(fmt.scheme, ())) for table, nbytes in fmt.tables()]
    if fmt.miss_copy is not None:
        m = fmt.miss_copy
        if not fmt.native or MISS_BITS.get(m.bits) != m.scheme:
            raise bad(f"small copies of {m.bits} bits as {m.scheme!r} beside {fmt.scheme} blobs")
        if m.blob_bytes > min(nbytes for _, nbytes in fmt.tables()):
            raise bad(f"small copies of {m.blob_bytes} bytes are larger than a blob")
        tables.append((m.tensors, m.blob_bytes, GGML_SCHEMES[m.scheme]))
    for table, blob_bytes, blocks in tables:
        names = [t.name for t in table]
        if names != [t.name for t in fmt.tensors]:
            raise bad(f"a layer's blob holds {names}, the others {[t.name for t in fmt.tensors]}")
        for t in table:
            known = t.dtype in DTYPES or (
                t.dtype in blocks and len(t.shape) == 2 and t.shape[1] % BLOCK_TYPES[t.dtype].elements == 0
            )
            if not known or t.offset % BLOB_ALIGN or t.offset + t.nbytes > blob_bytes:
                raise bad(f"tensor {t.name!r} ({t.dtype}, offset {t.offset}) is unknown, unaligned or outside the blob")
    for name, (dtype, shape) in (fmt.dense or {}).items():
        if dtype not in BLOCK_TYPES or len(shape) != 2 or shape[1] % BLOCK_TYPES[dtype].elements:
            raise bad(f"dense weight {name!r} is {dtype} {list(shape)}, not whole blocks of a type the kernels run")
    for t in fmt.tensors if not fmt.native else ():
        if t.name.endswith(".qweight"):
            want = _scales_shape(fmt, t)
            scales = next((s for s in fmt.tensors if s.name == t.name.replace(".qweight", ".scales")), None)
            if scales is None or scales.shape != want or scales.dtype != fmt.activation_dtype:
                got = None if scales is None else f"{scales.dtype}{list(scales.shape)}"
                raise bad(
                    f"scales of {t.name!r} are {got}, its {fmt.scheme} weight {list(t.shape)} needs "
                    f"{fmt.activation_dtype}{list(want)}"
                )


def _scales_shape(fmt: QuantFormat, qweight: BlobTensor) -> tuple[int, ...]:
    n, k_stored = qweight.shape
    if fmt.scheme == "int8":
        return (n,)
    return (2 * k_stored // fmt.group_size, n, 2)  # int4 stores K / 2 bytes per output channel
