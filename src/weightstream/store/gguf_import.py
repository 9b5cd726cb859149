"""`weightstream import`: a GGUF file (llama.cpp's format) as a model directory every command takes.

Routed experts keep their GGML blocks byte for byte when they are a type weightstream's native kernels run (Q8_0,
Q4_0, Q4_1, Q4_K, Q6_K; docs/kernels.md): one blob per expert in the quantized-experts format
(store/quant_format.py), gate rows then up rows, then down; a layer whose types differ from the others' (Q4_K_M
stores some down projections as Q6_K) gets its own table in the manifest. Other block types are dequantized and
requantized to Q8_0 or Q4_K, the error measured and said; experts stored as floats make a plain checkpoint.
Dense linear weights (attention, output head, shared experts, dense MLPs) of those same five types keep their
blocks byte for byte too, listed in the manifest's dense table as `quantize --dense` writes them, and load as
NativeLinear. The other dense weights (token embedding, router, norms, and linear weights of other types, or of
any type when the experts are floats) are stored unquantized in the activation dtype, dequantized where the file
quantized them, the loss said. llama.cpp's row permutation of attn_q/attn_k is undone where its converter applied
one: on float rows, or on the rows of blocks as they are. config.json comes from the file's metadata (our own
mapping: the one in transformers lacks fields these architectures need), the tokenizer from transformers' GGUF
tokenizer support.

The gguf package's GGUFReader parses the file; every tensor's bytes are then read with pread, one dense tensor
or one expert at a time, never through the reader's memory map (a mapped page once read stays in the process's
resident set until the kernel evicts it, so a file larger than memory would count whole). The output is built
beside `--out` and renamed into place when complete (store/outdir.py), the manifest written last. Every lossy
step is reported (`log`, stderr by default). docs/gguf.md has the rules and the measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import INDEX_NAME
from weightstream.store.dtypes import torch_name
from weightstream.store.ggml_quant import ENCODERS
from weightstream.store.outdir import built_in_place, refuse_existing
from weightstream.store.quant_format import (
    BLOCK_TYPES,
    GGML_SCHEMES,
    BlobTensor,
    QuantFormat,
    blob_key,
    blob_layout,
    row_bytes,
    write_manifest,
)
from weightstream.store.safetensors_writer import SafetensorsWriter


@dataclass(frozen=True, slots=True)
class _Arch:
    """What the importer needs to know of one GGUF architecture."""

    model_type: str  # transformers' name
    experts_field: str  # config field: routed experts per layer
    width_field: str  # config field: one expert's intermediate size
    norm_topk: bool | None  # llama.cpp renormalizes the top-k routing weights (None: the config has no such field)
    permuted_qk: bool  # llama.cpp's converter reordered attn_q/attn_k rows for its LLaMA-style rope


# GGUF `general.architecture` -> what it imports as. Mixtral is written as "llama" with an expert count.
ARCHS = {
    "qwen3moe": _Arch("qwen3_moe", "num_experts", "moe_intermediate_size", True, False),
    "qwen2moe": _Arch("qwen2_moe", "num_experts", "moe_intermediate_size", False, False),
    "olmoe": _Arch("olmoe", "num_experts", "intermediate_size", False, False),
    "llama": _Arch("mixtral", "num_local_experts", "intermediate_size", None, True),
}
SUPPORTED = "qwen3moe, qwen2moe, olmoe, llama with experts (Mixtral)"
# block types the native kernels run as they are stored
DIRECT = tuple(BLOCK_TYPES)
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
REQUANTIZE = ("auto", "q8_0", "q4_k")
PROJECTIONS = ("gate", "up", "down")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
_CHUNK = 16 * 2**20  # bytes of a dense tensor converted at a time
_MISSING = object()


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of a GGUF file: its GGML type, its shape outermost first (GGUF lists dims the other way round),
    and where its bytes are."""

    name: str
    type: str
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(self.rows, 1)


@dataclass(slots=True)
class GgufFile:
    """A GGUF model, one file or every part of a split one: the first part's metadata and all parts' tensors."""

    path: str
    parts: list[str]
    fields: dict
    tensors: dict[str, GgufTensor]

    def value(self, key: str, default=_MISSING, why: str = ""):
        if key in self.fields:
            return self.fields[key].contents()
        if default is _MISSING:
            raise WeightstreamError(
                f"{self.path}: metadata key {key!r} is missing{f' ({why})' if why else ''}; config.json cannot be "
                "written without it. The file was not made by llama.cpp's converter or is damaged: convert the "
                "model again with a current llama.cpp (convert_hf_to_gguf.py)"
            )
        return default

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.parts)


@dataclass(slots=True)
class _Loss:
    """A lossy conversion of some tensors: summed squared error and squared reference, worst tensor."""

    tensors: int = 0
    sse: float = 0.0
    ssr: float = 0.0
    worst: float = 0.0

    def add(self, sse: float, ssr: float) -> None:
        self.tensors += 1
        self.sse += sse
        self.ssr += ssr
        self.worst = max(self.worst, math.sqrt(sse / ssr) if ssr > 0 else 0.0)

    @property
    def rms(self) -> float:
        return math.sqrt(self.sse / self.ssr) if self.ssr > 0 else 0.0


@dataclass(slots=True)
class ImportResult:
    out_dir: str
    architecture: str  # the GGUF's
    model_type: str
    scheme: str | None  # None: the experts were floats, the directory is a plain checkpoint
    activation_dtype: str
    experts: int
    expert_types: dict[str, int]  # GGML type of the experts as stored in the output -> tensors (gate, up, down)
    dense_blocks: dict[str, int]  # GGML type -> dense linear weights kept as the file's blocks
    layer_tables: int  # layers whose blob table is their own
    requantized: list[dict]  # {"from", "to", "tensors", "rel_rms", "worst"}
    notes: list[str]
    total_bytes: int
    gguf_bytes: int
    seconds: float
    tokenizer: bool


# ---------------------------------------------------------------------------------------------------- reading


def open_gguf(path: str) -> GgufFile:
    """Parse a GGUF file (or every part of a `-0000i-of-0000N.gguf` split); errors name the file and the fault."""
    parts = gguf_parts(path)
    readers = [_read_part(p) for p in parts]
    tensors: dict[str, GgufTensor] = {}
    for i, (part, reader) in enumerate(zip(parts, readers, strict=True)):
        if len(parts) > 1:
            _check_split(part, reader, i, len(parts))
        for t in reader.tensors:
            if t.name in tensors:
                raise WeightstreamError(
                    f"{part}: tensor {t.name!r} is also in {tensors[t.name].path}; the parts do not belong together"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[t.name] = GgufTensor(t.name, t.tensor_type.name, shape, part, int(t.data_offset), int(t.n_bytes))
    first = readers[0]
    if len(parts) > 1:
        want = first.fields["split.tensors.count"].contents() if "split.tensors.count" in first.fields else None
        if want is not None and want != len(tensors):
            raise WeightstreamError(
                f"{parts[0]}: the split says {want} tensors, its {len(parts)} parts hold {len(tensors)}; a part is "
                "damaged or from another split: download or split the model again"
            )
    return GgufFile(parts[0], parts, dict(first.fields), tensors)


def gguf_parts(path: str) -> list[str]:
    """Every part of a split GGUF (`name-00001-of-00003.gguf` ...), or the one file."""
    if not os.path.isfile(path):
        raise WeightstreamError(
            f"{path}: {'is a directory' if os.path.isdir(path) else 'no such file'}; pass a .gguf file (for a split "
            "model, any of its -0000i-of-0000N.gguf parts)"
        )
    match = _SPLIT.match(os.path.basename(path))
    if not match:
        return [path]
    count = int(match["count"])
    folder = os.path.dirname(path)
    parts = [os.path.join(folder, f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing or not 1 <= int(match["no"]) <= count:
        raise WeightstreamError(
            f"{path}: part {int(match['no'])} of a {count}-part GGUF; missing beside it: "
            f"{', '.join(missing) or 'none (the part number is out of range)'}. Put every part in one directory"
        )
    return parts


def _read_part(path: str):
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise WeightstreamError(f"{path}: cannot read it ({exc.strerror})") from None
    if len(head) < 8 or head[:4] != b"GGUF":
        what = "is empty" if size == 0 else f"starts with {head[:4]!r}, not b'GGUF'"
        raise WeightstreamError(f"{path}: not a GGUF file (it {what}); pass a model file in llama.cpp's GGUF format")
    version = struct.unpack("<I", head[4:])[0]
    if version not in (2, 3):
        big = version & 0xFFFF == 0 and version >> 16 in (2, 3)  # a big-endian file's version, read little-endian
        raise WeightstreamError(
            f"{path}: "
            + (
                "a big-endian GGUF; weightstream reads little-endian files: convert the model on a little-endian "
                "machine"
                if big
                else f"GGUF version {version}; this importer reads versions 2 and 3 (llama.cpp writes 3): update the "
                "gguf package (pip install -U gguf) or convert the model again with a current llama.cpp"
            )
        )
    try:
        return _checked_reader()(path)
    except WeightstreamError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, struct.error, TypeError) as exc:
        raise WeightstreamError(
            f"{path}: the GGUF header is damaged or cut short ({type(exc).__name__}: {exc}); the file is incomplete "
            "or corrupt: download or convert it again"
        ) from None


_READER = None


def _checked_reader():
    """GGUFReader, refusing a tensor whose bytes run past the end of its file before it maps them."""
    global _READER
    if _READER is not None:
        return _READER
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def __init__(self, path: str):
            self._ws_path = path
            super().__init__(path, "r")

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for f in fields:
                _, name_data, _, dims, raw_type, offset = f.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise WeightstreamError(
                        f"{self._ws_path}: tensor {name!r} has GGML type id {int(raw_type[0])}, unknown to the gguf "
                        "package here; update it (pip install -U gguf) or convert the model to a common type"
                    ) from None
                block, type_size = GGML_QUANT_SIZES[kind]
                count = math.prod(int(d) for d in dims)
                start = start_offs + int(offset[0])
                end = start + count // block * type_size
                if count % block or end > size:
                    what = (
                        f"{count} values are not whole {kind.name} blocks of {block}"
                        if count % block
                        else f"its data (bytes {start} to {end}) runs past the end of the file ({size} bytes)"
                    )
                    raise WeightstreamError(
                        f"{self._ws_path}: tensor {name!r}: {what}; the file is truncated or damaged: download or "
                        "convert it again"
                    )
            super()._build_tensors(start_offs, fields)

    _READER = CheckedReader
    return _READER


def _check_split(part: str, reader, index: int, count: int) -> None:
    fields = reader.fields
    no = fields["split.no"].contents() if "split.no" in fields else None
    total = fields["split.count"].contents() if "split.count" in fields else None
    if no != index or total != count:
        raise WeightstreamError(
            f"{part}: its metadata says part {no} of {total} (counting from 0), its name part {index} of {count}; "
            "the parts were renamed or mixed up: use the files as llama.cpp's gguf-split wrote them"
        )


def _read(fd: int, path: str, offset: int, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    view, pos = memoryview(buf), offset
    while len(view):
        got = os.preadv(fd, [view], pos)
        if got <= 0:
            raise WeightstreamError(
                f"{path}: short read at byte {pos} ({nbytes} bytes from {offset} expected); the file changed or was "
                "cut short while importing"
            )
        view, pos = view[got:], pos + got
    return buf


# ---------------------------------------------------------------------------------------------------- config


def gguf_config(gf: GgufFile) -> tuple[str, dict]:
    """(GGUF architecture, transformers config fields) from the file's metadata, checked against its tensors."""
    arch = gf.value("general.architecture", why="the model's architecture")
    if arch not in ARCHS or (arch == "llama" and not gf.value("llama.expert_count", 0)):
        what = "a dense llama model (no experts)" if arch == "llama" else f"architecture {arch!r}"
        raise WeightstreamError(
            f"{gf.path}: {what}; weightstream streams Mixture-of-Experts models and imports these GGUF "
            f"architectures: {SUPPORTED}"
        )
    spec = ARCHS[arch]

    def key(name: str, default=_MISSING, why: str = ""):
        return gf.value(f"{arch}.{name}", default, why)

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise WeightstreamError(
            f"{gf.path}: rope scaling {scaling!r} ({arch}.rope.scaling.type); importing rope scaling is not "
            "supported yet: use a file converted without it"
        )
    heads = key("attention.head_count", why="attention heads")
    kv_heads = key("attention.head_count_kv", heads)
    for name, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if isinstance(value, list):
            raise WeightstreamError(
                f"{gf.path}: {arch}.{name} differs per layer ({value[:4]}...); not supported by {spec.model_type}"
            )
    hidden = key("embedding_length", why="hidden size")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2 or embed.shape[1] != hidden:
        got = "missing" if embed is None else f"shaped {list(embed.shape)}"
        raise WeightstreamError(
            f"{gf.path}: tensor 'token_embd.weight' is {got}, expected (vocabulary, {hidden}); the file is damaged"
        )
    fields = {
        "model_type": spec.model_type,
        "num_hidden_layers": key("block_count", why="layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": key("context_length", why="context length"),
        "rms_norm_eps": _decimal(key("attention.layer_norm_rms_epsilon", why="RMS norm epsilon")),
        "rope_theta": _decimal(key("rope.freq_base", 10000.0)),  # llama.cpp's default when a file has none
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        spec.experts_field: key("expert_count", why="routed experts per layer"),
        "num_experts_per_tok": key("expert_used_count", why="experts per token"),
    }
    width = key("expert_feed_forward_length", None)
    fields[spec.width_field] = width if width is not None else key("feed_forward_length", why="expert width")
    if spec.norm_topk is not None:
        fields["norm_topk_prob"] = bool(key("expert_weights_norm", spec.norm_topk))
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", why="shared expert width")
    if arch == "olmoe" and key("attention.clamp_kqv", None) is not None:
        fields["clip_qkv"] = _decimal(key("attention.clamp_kqv"))
    if arch in ("qwen3moe", "qwen2moe"):
        dense_layers = [
            i for i in range(fields["num_hidden_layers"]) if f"blk.{i}.ffn_gate_exps.weight" not in gf.tensors
        ]
        if dense_layers:
            fields["mlp_only_layers"] = dense_layers
            fields["intermediate_size"] = key("feed_forward_length", why="width of the dense layers")
    for name, config_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = gf.value(f"tokenizer.ggml.{name}_token_id", None)  # absent: none (not the config class's default)
        fields[config_key] = None if value is None else int(value)
    return arch, fields


def _decimal(value: float) -> float:
    """A float32 from the metadata as the shortest decimal it stores (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------------------------------- plan


@dataclass(slots=True)
class _Dense:
    key: str  # checkpoint key (the architecture's on-disk name)
    tensor: GgufTensor
    shape: tuple[int, ...]
    permute_heads: int | None = None  # undo llama.cpp's q/k row permutation with this many heads
    block: str | None = None  # the GGML type its blocks are kept in (a linear weight the native kernels run)
    why_float: str = ""  # why a quantized tensor is dequantized instead


@dataclass(slots=True)
class _Layer:
    layer: int
    path: str  # experts module path
    tensors: dict[str, GgufTensor]  # gate/up/down -> the 3D tensor
    targets: dict[str, str]  # gate/up/down -> the GGML type stored (its own, or what it is requantized to)
    table: tuple[BlobTensor, ...] = ()
    blob_bytes: int = 0
    float_keys: dict[str, list[str]] | None = None  # float experts: gate/up/down -> checkpoint key per expert


def _plan(gf: GgufFile, arch: str, fields: dict, requantize: str):
    """The meta model of the config, every dense tensor's GGUF source and checkpoint key, every MoE layer."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from weightstream.store.layout import experts_modules, layer_index
    from weightstream.store.quantize import dense_linears

    spec = ARCHS[arch]
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config.architectures = [type(model).__name__]
    modules = experts_modules(model)
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    state = model.state_dict(keep_vars=True)
    expert_params = {f"{p}.{n}" for p, m in modules.items() for n, _ in m.named_parameters(recurse=False)}
    dense_meta = {k: v for k, v in state.items() if k not in expert_params}
    if config.tie_word_embeddings:
        dense_meta.pop("lm_head.weight", None)
    used: set[str] = set()
    dense = []
    linears = {id(m.weight) for m in dense_linears(model).values()}  # what `quantize --dense` may store as blocks
    embedding = model.get_input_embeddings().weight
    for key, meta in revert_weight_conversion(model, dense_meta).items():
        source = _gguf_name(names, key)
        t = gf.tensors.get(source)
        if t is None:
            raise WeightstreamError(
                f"{gf.path}: tensor {source!r} ({key} of {spec.model_type}) is missing; the metadata and the "
                "tensors disagree or the file is damaged: convert the model again"
            )
        shape = tuple(meta.shape)
        if math.prod(t.shape) != math.prod(shape) or (len(t.shape) == len(shape) and t.shape != shape):
            raise WeightstreamError(
                f"{gf.path}: tensor {source!r} is shaped {list(t.shape)}, the {spec.model_type} model the metadata "
                f"describes needs {list(shape)} for {key}; the metadata and the tensors disagree"
            )
        permute = None
        if spec.permuted_qk and re.search(r"\.self_attn\.[qk]_proj\.weight$", key):
            permute = config.num_attention_heads if ".q_proj." in key else config.num_key_value_heads
        block, why = _dense_block(t, shape, id(meta) in linears, meta is embedding)
        dense.append(_Dense(key, t, shape, permute, block, why))
        used.add(source)
    layers = []
    for path, module in modules.items():
        layer = layer_index(path, -1)
        tensors = {}
        for proj in PROJECTIONS:
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            t = gf.tensors.get(name)
            if t is None:
                old = f"blk.{layer}.ffn_{proj}.0.weight" in gf.tensors
                raise WeightstreamError(
                    f"{gf.path}: tensor {name!r} is missing"
                    + (
                        " (this file stores one tensor per expert, as llama.cpp did before 2024): convert the model "
                        "again with a current llama.cpp"
                        if old
                        else "; the metadata and the tensors disagree or the file is damaged"
                    )
                )
            tensors[proj] = t
            used.add(name)
        inter, hidden, n = module.intermediate_dim, module.hidden_dim, module.num_experts
        for proj, want in (("gate", (n, inter, hidden)), ("up", (n, inter, hidden)), ("down", (n, hidden, inter))):
            if tensors[proj].shape != want:
                raise WeightstreamError(
                    f"{gf.path}: tensor {tensors[proj].name!r} is shaped {list(tensors[proj].shape)} (experts, "
                    f"outputs, inputs); the metadata says {list(want)}: the metadata and the tensors disagree"
                )
        if tensors["gate"].type != tensors["up"].type:
            raise WeightstreamError(
                f"{gf.path}: {tensors['gate'].name!r} is {tensors['gate'].type} and {tensors['up'].name!r} is "
                f"{tensors['up'].type}; weightstream runs gate and up as one matrix, which needs one type: "
                "requantize the file so both have the same type (llama-quantize --tensor-type)"
            )
        layers.append(_Layer(layer, path, tensors, {}))
    extra = sorted(set(gf.tensors) - used)
    if extra:
        raise WeightstreamError(
            f"{gf.path}: tensor(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} have no place in the "
            f"{spec.model_type} model its metadata describes; this variant of {arch} is not supported"
        )
    floats = [t.type in FLOATS for lay in layers for t in lay.tensors.values()]
    if all(floats):
        _float_expert_keys(model, modules, layers, names)
        for d in dense:  # a plain checkpoint has no manifest to list blocks in
            if d.block:
                d.block, d.why_float = None, "the experts are floats: a plain checkpoint, with no table of blocks"
    else:
        for lay in layers:
            lay.targets = {p: _target(gf, t, requantize) for p, t in lay.tensors.items()}
    return config, model, dense, layers


def _dense_block(t: GgufTensor, shape: tuple[int, ...], linear: bool, embedding: bool) -> tuple[str | None, str]:
    """(the GGML type a dense tensor keeps, or None; why a quantized one is dequantized instead)."""
    if t.type in FLOATS:
        return None, ""
    if embedding:
        return None, "the token embedding is a row lookup, not a product the native kernels run"
    if not linear:
        return None, "not the weight of a linear layer the native kernels run (routers stay float)"
    if t.type not in BLOCK_TYPES:
        return None, f"the native kernels do not run {t.type}"
    if len(shape) != 2 or t.shape != shape or shape[1] % BLOCK_TYPES[t.type][0]:
        return None, f"shaped {list(t.shape)}, not rows of whole {t.type} blocks"
    return t.type, ""


def _gguf_name(names, key: str) -> str:
    base, _, suffix = key.rpartition(".")
    if suffix not in ("weight", "bias"):
        base, suffix = key, ""
    name = names.get_name(base)
    if name is None:
        raise WeightstreamError(f"{key}: no GGUF tensor name is known for it (gguf package {_gguf_version()})")
    return f"{name}.{suffix}" if suffix else name


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _float_expert_keys(model, modules, layers: list[_Layer], names) -> None:
    """Float experts go into a plain checkpoint under the architecture's own per-expert keys."""
    from transformers.core_model_loading import revert_weight_conversion

    for lay in layers:
        module = modules[lay.path]
        meta = {f"{lay.path}.{n}": p for n, p in module.named_parameters(recurse=False)}
        lay.float_keys = {p: [""] * module.num_experts for p in PROJECTIONS}
        for key in revert_weight_conversion(model, meta):
            match = re.search(r"\.experts\.(\d+)\.", key)
            if match is None:
                raise WeightstreamError(f"{key}: fused expert tensors on disk are not supported for float experts")
            source = _gguf_name(names, key[: match.start()] + ".experts." + key[match.end() :])
            proj = next(p for p, t in lay.tensors.items() if t.name == source)
            lay.float_keys[proj][int(match.group(1))] = key


def _target(gf: GgufFile, t: GgufTensor, requantize: str) -> str:
    """The GGML type an expert tensor is stored in: its own where the kernels run it, else what it is requantized to."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if t.type in DIRECT:
        return t.type
    k = t.shape[-1]
    if requantize == "auto":
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t.type]]
        want = "Q4_K" if 8 * size / block <= 4.5 else "Q8_0"  # at most 4.5 bits a weight: keep it at 4
    else:
        want = requantize.upper()
    if want == "Q4_K" and k % 256:
        want = "Q8_0"
    if k % 32 or not _dequantizable(t.type):
        raise WeightstreamError(
            f"{gf.path}: expert tensor {t.name!r} is {t.type}"
            + (f" with {k} inputs, not whole blocks of 32" if k % 32 else ", which the gguf package cannot decode")
            + f"; the native kernels run {', '.join(DIRECT)}: requantize the file to one of them (llama-quantize)"
        )
    return want


def _dequantizable(kind: str) -> bool:
    from gguf import GGML_QUANT_SIZES, quants

    if kind in FLOATS:
        return True
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[_kind(kind)][1]), np.uint8), _kind(kind))
    except NotImplementedError:
        return False
    return True


def _kind(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def _scheme(layers: list[_Layer]) -> str:
    kinds = {k for lay in layers for k in lay.targets.values()}
    for scheme in ("q8_0", "q4_1", "q4_k"):
        if kinds <= set(GGML_SCHEMES[scheme]):
            return scheme
    raise AssertionError(kinds)


def _tables(layers: list[_Layer], scheme: str, act: str, source: dict) -> QuantFormat:
    """Each layer's blob table; the manifest's default table is the commonest one, the others per layer."""
    for lay in layers:
        inter, hidden = lay.tensors["gate"].shape[1], lay.tensors["gate"].shape[2]
        lay.table, lay.blob_bytes = blob_layout(
            [
                ("gate_up_proj.qweight", lay.targets["gate"], (2 * inter, hidden)),
                ("down_proj.qweight", lay.targets["down"], (hidden, inter)),
            ]
        )
    counts = Counter((lay.table, lay.blob_bytes) for lay in layers)
    base = counts.most_common(1)[0][0]  # every kept type has an encoder, so the load-time check runs on it
    own = {lay.layer: (lay.table, lay.blob_bytes) for lay in layers if (lay.table, lay.blob_bytes) != base}
    return QuantFormat(scheme, act, base[0], base[1], source=source, layer_tables=own or None)


def _activation_dtype(dense: list[_Dense], layers: list[_Layer]) -> torch.dtype:
    """float32 when every dense matrix stored as floats (the router aside: llama.cpp always writes it F32) and
    every float expert tensor is F32; bfloat16 otherwise (quantized, F16 or BF16 weights).

    Dense weights kept as blocks do not vote: they are not stored in the activation dtype, so no choice rounds
    them. What the choice decides is the dtype of the floats stored (the embedding, dequantized when the file
    quantized it, norms, router); a quantized file's embedding is one of those matrices, so it is stored in
    bfloat16. The engine computes a directory whose dense linear weights are blocks in float32 whatever this says
    (`QuantFormat.compute_dtype`): norms and router converted at load, the embedding's rows as they are looked up."""
    kinds = {d.tensor.type for d in dense if len(d.shape) > 1 and "ffn_gate_inp" not in d.tensor.name and not d.block}
    kinds |= {t.type for lay in layers if lay.float_keys for t in lay.tensors.values()}
    return torch.float32 if kinds == {"F32"} else torch.bfloat16


# ---------------------------------------------------------------------------------------------------- import


def import_gguf(
    path: str,
    out: str,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    requantize: str = "auto",
    log: Callable[[str], None] | None = None,
) -> ImportResult:
    """Write `out`: the GGUF model at `path` as a model directory (config, tokenizer, dense safetensors, experts).

    `requantize` decides what expert types the native kernels cannot run become (auto: Q4_K for types of at most
    4.5 bits a weight, else Q8_0; or q8_0, or q4_k); the types they run are kept as they are. `log` receives
    every note on a lossy step (default: stderr)."""
    start = time.perf_counter()
    log = log or (lambda line: print(f"weightstream import: {line}", file=sys.stderr))
    if requantize not in REQUANTIZE:
        raise WeightstreamError(f"--requantize {requantize!r}: choose one of {', '.join(REQUANTIZE)}")
    gf = open_gguf(path)
    refuse_existing(out, force, sources=gf.parts)
    arch, fields = gguf_config(gf)
    config, model, dense, layers = _plan(gf, arch, fields, requantize)
    dtype = _activation_dtype(dense, layers)
    quant = None
    if layers[0].float_keys is None:
        source = {
            "gguf": os.path.basename(gf.path),
            "architecture": arch,
            "model_type": config.model_type,
            "expert_types": dict(Counter(t.type for lay in layers for t in lay.tensors.values())),
        }
        quant = _tables(layers, _scheme(layers), torch_name(dtype), source)
        blocks = {d.key: (d.block, d.shape) for d in dense if d.block}  # as `quantize --dense` lists them
        quant = dataclasses.replace(quant, dense=blocks or None)
    tokenizer, why = _tokenizer(gf)
    losses: dict[tuple[str, str, str], _Loss] = {}
    notes = []
    with built_in_place(out, "import", note={"source": os.path.abspath(gf.path)}) as tmp:
        total = _write(gf, dense, layers, dtype, tmp, progress, losses)
        config.dtype = dtype
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if quant is not None:
            write_manifest(tmp, quant)  # last: without it the directory is not a quantized checkpoint
    notes += _loss_notes(losses)
    if why:
        notes.append(f"no tokenizer written ({why}); --prompt-ids works, text prompts need a tokenizer in {out}")
    notes += _dequantized_notes(dense, dtype)
    for line in notes:
        log(line)
    requantized = [
        {"from": k[1], "to": k[2], "tensors": v.tensors, "rel_rms": v.rms, "worst": v.worst}
        for k, v in sorted(losses.items())
        if k[0] == "experts"
    ]
    stored = Counter(
        k for lay in layers for p, k in (lay.targets or {p: t.type for p, t in lay.tensors.items()}).items()
    )
    return ImportResult(
        out,
        arch,
        config.model_type,
        quant.scheme if quant else None,
        torch_name(dtype),
        sum(m.tensors["gate"].shape[0] for m in layers),
        dict(stored),
        dict(sorted(Counter(d.block for d in dense if d.block).items())),
        len(quant.layer_tables or {}) if quant else 0,
        requantized,
        notes,
        total,
        gf.nbytes,
        time.perf_counter() - start,
        tokenizer is not None,
    )


def _dequantized_notes(dense: list[_Dense], dtype: torch.dtype) -> list[str]:
    """One line per reason a dense tensor the file quantized is stored as floats (its error is said apart)."""
    why: dict[str, list[GgufTensor]] = {}
    for d in dense:
        if d.tensor.type not in FLOATS and not d.block:
            why.setdefault(d.why_float, []).append(d.tensor)
    lines = []
    for reason, tensors in why.items():
        kinds = Counter(t.type for t in tensors)
        names = ", ".join(t.name for t in tensors[:3]) + (" ..." if len(tensors) > 3 else "")
        lines.append(
            "dense weights: "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f" tensor(s) dequantized to {torch_name(dtype)} ({names}): {reason}"
        )
    return lines


def _write(gf, dense: list[_Dense], layers: list[_Layer], dtype, out: str, progress, losses) -> int:
    """Shards by decoder layer (its dense tensors and its experts), as `weightstream quantize` writes them."""
    from weightstream.store.layout import layer_index

    shards: dict[int, list] = {}
    for d in dense:
        shards.setdefault(layer_index(d.key, -1), []).append(d)
    for lay in layers:
        shards.setdefault(lay.layer, []).append(lay)
    todo = sum(d.tensor.nbytes for d in dense) + sum(t.nbytes for lay in layers for t in lay.tensors.values())
    fds = {p: os.open(p, os.O_RDONLY) for p in gf.parts}
    done, weight_map, total = 0, {}, 0
    try:
        for i, layer in enumerate(sorted(shards)):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            specs = {}
            for item in shards[layer]:
                specs |= _specs(item, dtype)
            with SafetensorsWriter(os.path.join(out, file), specs, metadata={"format": "pt"}) as writer:
                for item in shards[layer]:
                    if isinstance(item, _Dense):
                        if item.block:
                            writer.write(item.key, _dense_blocks(item, fds))
                        else:
                            writer.write(item.key, _dense_tensor(item, dtype, fds, losses))
                        done += item.tensor.nbytes
                        if progress:
                            progress(done, todo)
                        continue
                    for e in range(item.tensors["gate"].shape[0]):
                        for key, tensor in _expert(item, e, dtype, fds, losses):
                            writer.write(key, tensor)
                        done += sum(t.nbytes // t.shape[0] for t in item.tensors.values())
                        if progress:
                            progress(done, todo)
                    _close_expert_losses(item, losses)
                total += writer.total_bytes
            weight_map |= {k: file for k in specs}
    finally:
        for fd in fds.values():
            os.close(fd)
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return total


def _specs(item, dtype) -> dict:
    if isinstance(item, _Dense) and item.block:  # (out, row bytes), as `quantize --dense` stores blocks
        return {item.key: (torch.uint8, (item.shape[0], row_bytes(item.block, item.shape[1])))}
    if isinstance(item, _Dense):
        return {item.key: (dtype, item.shape)}
    n, inter, hidden = item.tensors["gate"].shape
    if item.float_keys is None:
        return {blob_key(item.path, e): (torch.uint8, (item.blob_bytes,)) for e in range(n)}
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {key: (dtype, shapes[p]) for p, keys in item.float_keys.items() for key in keys}


def _dense_tensor(d: _Dense, dtype: torch.dtype, fds, losses) -> torch.Tensor:
    """One dense tensor in `dtype`, converted a chunk of rows at a time; q/k rows put back in transformers' order."""
    t = d.tensor
    rows, row_bytes = t.rows, t.row_bytes
    k = t.shape[-1]
    out = torch.empty((rows, k), dtype=dtype)
    exact = FLOATS.get(t.type) == dtype
    sse = ssr = 0.0
    step = max(1, _CHUNK // max(row_bytes, 1))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        raw = _read(fds[t.path], t.path, t.offset + r * row_bytes, n * row_bytes)
        values = _decode(raw, t.type, n, k)
        out[r : r + n] = values
        if not exact:
            sse += float((out[r : r + n].double() - values.double()).pow(2).sum())
            ssr += float(values.double().pow(2).sum())
    if not exact:
        losses.setdefault(("dense", t.type, torch_name(dtype)), _Loss()).add(sse, ssr)
    if d.permute_heads:
        out = _unpermute_rows(out, d.permute_heads)
    return out.reshape(d.shape)


def _dense_blocks(d: _Dense, fds) -> torch.Tensor:
    """A dense linear weight's GGML blocks as the file stores them, uint8 (out, row bytes); q/k rows put back in
    transformers' order (whole rows of blocks moved: no value changes)."""
    t = d.tensor
    raw = torch.from_numpy(_read(fds[t.path], t.path, t.offset, t.nbytes)).reshape(t.rows, t.row_bytes)
    return _unpermute_rows(raw, d.permute_heads) if d.permute_heads else raw


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation of the rows of `x` (rows, anything): it stored row (head, half, i) of each
    head at (head, i, half). A float weight's rows or a block weight's rows of bytes alike."""
    rows, width = x.shape
    return x.reshape(heads, -1, 2, width).transpose(1, 2).reshape(rows, width).contiguous()


def _decode(raw: np.ndarray, kind: str, rows: int, k: int) -> torch.Tensor:
    """float values (rows, k) of a tensor's bytes: the float types as they are, blocks through gguf's decoder."""
    if kind in FLOATS:
        return torch.frombuffer(raw, dtype=FLOATS[kind]).reshape(rows, k) if raw.size else torch.empty(rows, k)
    from gguf import quants

    return torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), _kind(kind))).reshape(rows, k)


def _expert(lay: _Layer, e: int, dtype, fds, losses):
    """(checkpoint key, tensor) of expert `e`: its blob, or its float tensors."""
    pieces = {}
    for proj, t in lay.tensors.items():
        per = t.nbytes // t.shape[0]
        pieces[proj] = _read(fds[t.path], t.path, t.offset + e * per, per)
    if lay.float_keys is not None:
        for proj, t in lay.tensors.items():
            values = _decode(pieces[proj], t.type, t.shape[1], t.shape[2])
            got = values.to(dtype)
            if FLOATS[t.type] != dtype:
                acc = losses.setdefault(("experts-float", t.type, torch_name(dtype), lay.layer, proj), _Loss())
                acc.sse += float((got.double() - values.double()).pow(2).sum())
                acc.ssr += float(values.double().pow(2).sum())
            yield lay.float_keys[proj][e], got
        return
    blob = np.zeros(lay.blob_bytes, dtype=np.uint8)
    gate_up, down = lay.table
    at = {"gate": gate_up.offset, "up": gate_up.offset + gate_up.nbytes // 2, "down": down.offset}
    for proj, t in lay.tensors.items():
        data = pieces[proj]
        target = lay.targets[proj]
        if target != t.type:
            data = _requantize(data, t, target, lay, proj, losses)
        blob[at[proj] : at[proj] + data.size] = data
    yield blob_key(lay.path, e), torch.from_numpy(blob)


def _requantize(raw: np.ndarray, t: GgufTensor, target: str, lay: _Layer, proj: str, losses) -> np.ndarray:
    from gguf import quants

    rows, k = t.shape[1], t.shape[2]
    values = _decode(raw, t.type, rows, k).float()
    encoded = ENCODERS[target](values)
    back = torch.from_numpy(quants.dequantize(encoded.numpy(), _kind(target))).reshape(rows, k)
    acc = losses.setdefault(("expert-tensor", t.type, target, lay.layer, proj), _Loss())
    acc.sse += float((back.double() - values.double()).pow(2).sum())
    acc.ssr += float(values.double().pow(2).sum())
    return encoded.numpy().reshape(-1)


def _close_expert_losses(lay: _Layer, losses) -> None:
    """Fold a layer's per-tensor sums (over its experts) into one entry per conversion."""
    for key in [k for k in losses if len(k) == 5 and k[3] == lay.layer]:
        acc = losses.pop(key)
        kind = "experts" if key[0] == "expert-tensor" else "experts-float"
        losses.setdefault((kind, key[1], key[2]), _Loss()).add(acc.sse, acc.ssr)


def _loss_notes(losses: dict) -> list[str]:
    lines = []
    for (kind, src, dst), acc in sorted(losses.items()):
        if acc.sse == 0:
            continue
        what = {
            "dense": f"dense weights: {acc.tensors} {src} tensor(s) stored as {dst}",
            "experts": f"experts: {acc.tensors} {src} tensor(s) requantized to {dst} (the native kernels do not run "
            f"{src})",
            "experts-float": f"experts: {acc.tensors} {src} tensor(s) stored as {dst}",
        }[kind]
        lines.append(
            f"{what}: relative RMS error {acc.rms:.3%} against the GGUF's own values, {acc.worst:.3%} in the worst "
            "tensor"
        )
    return lines


# ---------------------------------------------------------------------------------------------------- tokenizer


def _tokenizer(gf: GgufFile):
    """The file's tokenizer, built by transformers' GGUF tokenizer support, saved as a plain tokenizer.json; or
    (None, why not)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(gf.path)
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as exc:  # said on stderr: the weights import without it
        return None, f"transformers cannot build it from this file's metadata: {type(exc).__name__}: {exc}"
    # transformers' builders add their class's default special tokens (GPT-2's <|endoftext|>) past the end of a
    # vocabulary that lacks them: ids the embedding does not have. Drop what the file did not list.
    n = len(tokenizer_dict["tokens"])
    data = json.loads(backend.to_str())
    data["added_tokens"] = [a for a in data.get("added_tokens", []) if a["id"] < n]
    backend = Tokenizer.from_str(json.dumps(data))
    specials = {k: tokenizer_config[k] for k in _SPECIALS if tokenizer_config.get(k) is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    if tokenizer_config.get("chat_template"):
        tokenizer.chat_template = tokenizer_config["chat_template"]
    return tokenizer, None
