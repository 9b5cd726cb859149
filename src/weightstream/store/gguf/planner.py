"""The import plan: the meta model the config describes, every dense tensor's GGUF source(s) and checkpoint key,
and every MoE layer's stacked expert tensors (and biases, where the model's experts have them: gpt-oss) with the
GGML type each is stored in (the file's own where the native kernels run it, else what it is requantized to).
Nothing is read here but the header."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from weightstream.errors import WeightstreamError
from weightstream.store.gguf.families import FAMILIES, DenseSource
from weightstream.store.gguf.families.base import check_shape
from weightstream.store.gguf.reader import FLOATS, GgufFile, GgufTensor, dequantizable
from weightstream.store.quant.manifest import BLOCK_TYPES, GGML_SCHEMES, BlobTensor, QuantFormat, blob_layout

# block types the native kernels run as they are stored
DIRECT = tuple(BLOCK_TYPES)
PROJECTIONS = ("gate", "up", "down")


@dataclass(slots=True)
class Dense:
    key: str  # checkpoint key (the architecture's on-disk name)
    tensor: GgufTensor  # its GGUF tensor (the first, when it is joined from several)
    shape: tuple[int, ...]
    permute_heads: int | None = None  # undo llama.cpp's q/k row permutation with this many heads
    block: str | None = None  # the GGML type its blocks are kept in (a linear weight the native kernels run)
    why_float: str = ""  # why a quantized tensor is dequantized instead
    source: DenseSource | None = None  # how it is read when not one tensor as it is (joined from several)
    dtype: torch.dtype | None = None  # stored in this dtype whatever the activation dtype (the family says)

    @property
    def parts(self) -> tuple[GgufTensor, ...]:
        return self.source.parts if self.source is not None else (self.tensor,)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)


@dataclass(slots=True)
class Layer:
    layer: int
    path: str  # experts module path
    tensors: dict[str, GgufTensor]  # gate/up/down -> the 3D tensor
    targets: dict[str, str]  # gate/up/down -> the GGML type stored (its own, or what it is requantized to)
    table: tuple[BlobTensor, ...] = ()
    blob_bytes: int = 0
    float_keys: dict[str, list[str]] | None = None  # float experts: gate/up/down -> checkpoint key per expert
    biases: dict[str, GgufTensor] | None = None  # gate/up/down -> its (experts, outputs) bias (gpt-oss)
    interleaved: bool = False  # gate_up rows (and bias) alternate gate and up, as the model's gate takes them

    @property
    def nbytes(self) -> int:
        """Bytes of the file this layer's experts read: the 3D tensors and their biases."""
        return sum(t.nbytes for t in (*self.tensors.values(), *(self.biases or {}).values()))


@dataclass(slots=True)
class Plan:
    config: object  # the transformers config
    model: torch.nn.Module  # on the meta device
    dense: list[Dense]
    layers: list[Layer]
    notes: list[str] = field(default_factory=list)  # what the import leaves out, and why


def plan(gf: GgufFile, arch: str, fields: dict, requantize: str) -> Plan:
    """The meta model of the config, every dense tensor's GGUF source and checkpoint key, every MoE layer."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from weightstream.store.layout import experts_modules, layer_index
    from weightstream.store.quant.plan import dense_linears

    family = FAMILIES[arch]
    fields = dict(fields)
    model_type = fields.pop("model_type")
    try:  # the metadata's values, checked by transformers' config class and the model it builds (on no memory)
        config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except (StrictDataclassError, ValueError, TypeError, ZeroDivisionError, OverflowError, RuntimeError) as exc:
        why = " ".join(str(exc).split())
        raise WeightstreamError(
            f"{gf.path}: its metadata describes a {model_type} model transformers cannot build ({type(exc).__name__}: "
            f"{why[:300]}); the file is damaged or its values are out of range: convert the model again with a "
            "current llama.cpp"
        ) from None
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
        shape = tuple(meta.shape)
        source = family.dense_source(gf, key, shape, names, config)
        dtype = torch.float32 if key.endswith(family.float32_keys) else None
        if source.build is None:
            t = source.parts[0]
            block, why = _dense_block(t, shape, id(meta) in linears, meta is embedding)
            dense.append(Dense(key, t, shape, source.permute_heads, block, why, dtype=dtype))
        else:
            dense.append(Dense(key, source.parts[0], shape, why_float=source.why_float, source=source, dtype=dtype))
        used.update(t.name for t in source.parts)
    layers = []
    for path, module in modules.items():
        layer = layer_index(path, -1)
        n, inter, hidden = _expert_dims(module)
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
        biases = {}
        for proj, want in (("gate", (n, inter)), ("up", (n, inter)), ("down", (n, hidden))) if module.has_bias else ():
            name, key = (
                f"blk.{layer}.ffn_{proj}_exps.bias",
                f"{path}.{'down' if proj == 'down' else 'gate_up'}_proj_bias",
            )
            t = family.tensor(gf, name, key, config)
            check_shape(gf, t, want, key, config)
            biases[proj] = t
            used.add(name)
        layers.append(Layer(layer, path, tensors, {}, biases=biases or None, interleaved=family.gate_up_interleaved))
    notes = []
    for skipped in family.skipped(gf, config):
        used.update(skipped.names)
        notes.append(skipped.note)
    extra = sorted(set(gf.tensors) - used)
    if extra:
        raise WeightstreamError(
            f"{gf.path}: tensor(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} have no place in the "
            f"{config.model_type} model its metadata describes; this variant of {arch} is not supported"
        )
    floats = all(t.type in FLOATS for lay in layers for t in lay.tensors.values())
    if floats and _float_expert_keys(model, modules, layers, names, family):
        for d in dense:  # a plain checkpoint has no manifest to list blocks in
            if d.block:
                d.block, d.why_float = None, "the experts are floats: a plain checkpoint, with no table of blocks"
    else:
        dense = [part for d in dense for part in _kept_apart(family, d, config)]
        for lay in layers:
            # float experts the checkpoint would store fused (a whole layer per tensor, gpt-oss's): the import
            # writes one expert at a time, so they go into blobs as BF16 rows the native kernels run
            lay.targets = {p: "BF16" if floats else _target(gf, t, requantize) for p, t in lay.tensors.items()}
    return Plan(config, model, dense, layers, notes)


def _kept_apart(family, d: Dense, config) -> list[Dense]:
    """A joined dense tensor as the parts the family keeps apart, each the file's own blocks; else [d]."""
    if d.source is None:
        return [d]
    parts = family.kept_apart(d.key, d.source, config)
    return [Dense(key, t, shape, block=t.type, dtype=d.dtype) for key, t, shape in parts] or [d]


def _expert_dims(module) -> tuple[int, int, int]:
    """(experts, intermediate, hidden) of an experts module, from its down projection (stored (E, I, H) where the
    module's weights are transposed, gpt-oss's, else (E, H, I))."""
    n, a, b = module.down_proj.shape
    return (n, a, b) if module.is_transposed else (n, b, a)


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


def _float_expert_keys(model, modules, layers: list[Layer], names, family) -> bool:
    """Float experts go into a plain checkpoint under the architecture's own per-expert keys. False (nothing set)
    where the architecture's checkpoint stores them fused, a whole layer per tensor (gpt-oss)."""
    from transformers.core_model_loading import revert_weight_conversion

    keys = {}
    for lay in layers:
        module = modules[lay.path]
        meta = {f"{lay.path}.{n}": p for n, p in module.named_parameters(recurse=False)}
        keys[lay.layer] = {p: [""] * module.num_experts for p in PROJECTIONS}
        for key in revert_weight_conversion(model, meta):
            match = re.search(r"\.experts\.(\d+)\.", key)
            if match is None or lay.biases:
                return False
            source = family.gguf_name(names, key[: match.start()] + ".experts." + key[match.end() :])
            proj = next(p for p, t in lay.tensors.items() if t.name == source)
            keys[lay.layer][proj][int(match.group(1))] = key
    for lay in layers:
        lay.float_keys = keys[lay.layer]
    return True


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
    if k % 32 or not dequantizable(t.type):
        raise WeightstreamError(
            f"{gf.path}: expert tensor {t.name!r} is {t.type}"
            + (f" with {k} inputs, not whole blocks of 32" if k % 32 else ", which the gguf package cannot decode")
            + f"; the native kernels run {', '.join(DIRECT)}: requantize the file to one of them (llama-quantize)"
        )
    return want


def scheme(layers: list[Layer]) -> str:
    kinds = {k for lay in layers for k in lay.targets.values()}
    for name in ("q8_0", "q4_1", "q4_k", "bf16"):
        if kinds <= set(GGML_SCHEMES[name]):
            return name
    raise AssertionError(kinds)


def tables(layers: list[Layer], scheme: str, act: str, source: dict) -> QuantFormat:
    """Each layer's blob table; the manifest's default table is the commonest one, the others per layer. Biases
    follow their projection in the activation dtype, as `weightstream quantize` lays out a gpt-oss expert."""
    for lay in layers:
        inter, hidden = lay.tensors["gate"].shape[1], lay.tensors["gate"].shape[2]
        entries = [("gate_up_proj.qweight", lay.targets["gate"], (2 * inter, hidden))]
        entries += [("gate_up_proj_bias", act, (2 * inter,))] if lay.biases else []
        entries += [("down_proj.qweight", lay.targets["down"], (hidden, inter))]
        entries += [("down_proj_bias", act, (hidden,))] if lay.biases else []
        lay.table, lay.blob_bytes = blob_layout(entries)
    counts = Counter((lay.table, lay.blob_bytes) for lay in layers)
    base = counts.most_common(1)[0][0]  # every kept type has an encoder, so the load-time check runs on it
    own = {lay.layer: (lay.table, lay.blob_bytes) for lay in layers if (lay.table, lay.blob_bytes) != base}
    return QuantFormat(scheme, act, base[0], base[1], source=source, layer_tables=own or None)


def activation_dtype(dense: list[Dense], layers: list[Layer]) -> torch.dtype:
    """float32 when every dense matrix stored as floats (the router aside: llama.cpp always writes it F32) and
    every float expert tensor is F32; bfloat16 otherwise (quantized, F16 or BF16 weights).

    Dense weights kept as blocks do not vote: they are not stored in the activation dtype, so no choice rounds
    them. What the choice decides is the dtype of the floats stored (the embedding, dequantized when the file
    quantized it, norms, router); a quantized file's embedding is one of those matrices, so it is stored in
    bfloat16. The engine computes a directory whose dense linear weights are blocks in float32 whatever this says
    (`QuantFormat.compute_dtype`): norms and router converted at load, the embedding's rows as they are looked up."""
    kinds = {
        t.type
        for d in dense
        if len(d.shape) > 1 and "ffn_gate_inp" not in d.tensor.name and not d.block
        for t in d.parts
    }
    kinds |= {t.type for lay in layers if lay.float_keys for t in lay.tensors.values()}
    return torch.float32 if kinds == {"F32"} else torch.bfloat16
