"""GGUF files written the way llama.cpp's converter lays them out, and what the import tests read back: shared by
tests/test_gguf_import.py, tests/test_gguf_import_families.py and the fault and fuzz tests."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants
from safetensors import safe_open

from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.gguf_import import import_gguf
from weightstream.store.quant.ggml_blocks import ENCODERS

from engine_support import greedy_run

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])


def built_once(make):
    """make(key) -> value, computed once a key: a module fixture's models and files, shared by its tests."""
    built = {}

    def get(key):
        if key not in built:
            built[key] = make(key)
        return built[key]

    return get


def importer(tmp_path_factory, gguf_of):
    """imported(recipe) -> (gguf path, imported directory), built once a recipe; imported.results[recipe]: its
    ImportResult. `gguf_of(recipe, folder)` writes the recipe's file in `folder` and returns its path."""

    def make(recipe: str):
        tmp = tmp_path_factory.mktemp(recipe)
        path = gguf_of(recipe, tmp)
        out = str(tmp / "out")
        imported.results[recipe] = import_gguf(path, out, log=lambda line: None)
        return path, out

    imported = built_once(make)
    imported.results = {}
    return imported


def encode(w: torch.Tensor, kind: str, seed: int) -> np.ndarray:
    """(N, K) floats -> (N, row bytes) GGML blocks: weightstream's encoders, gguf's, or for types neither encodes
    (IQ4_NL) random blocks with sane fp16 scales (the values then are the blocks', not `w`'s)."""
    if kind in ENCODERS:
        return ENCODERS[kind](w.float()).numpy()
    if kind == "F32":
        return w.float().numpy()
    if kind == "F16":
        return w.half().numpy()
    assert kind == "IQ4_NL"
    n, k = w.shape
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    at = 0  # the fp16 scale
    raw[..., at : at + 2] = rng.uniform(1e-5, 3e-5, size=(n, k // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def tokenizer_meta(src: str, vocab: int) -> list:
    tj = json.load(open(os.path.join(src, "tokenizer.json")))
    tokens = [None] * len(tj["model"]["vocab"])
    for token, i in tj["model"]["vocab"].items():
        tokens[i] = token
    types = [1] * len(tokens)  # NORMAL
    for added in tj["added_tokens"]:
        types[added["id"]] = 3  # CONTROL
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]  # llama.cpp pads the list to the embedding's rows
    types += [5] * (vocab - len(types))
    ids = {t: i for i, t in enumerate(tokens)}
    return [
        ("tokenizer.ggml.model", "gpt2"),
        ("tokenizer.ggml.pre", "gpt-2"),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.token_type", types),
        ("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]),
        ("tokenizer.ggml.bos_token_id", ids["<|bos|>"]),
        ("tokenizer.ggml.eos_token_id", ids["<|eos|>"]),
        ("tokenizer.ggml.padding_token_id", ids["<|pad|>"]),
    ]


def write_gguf(path, arch, meta, tensors, split_max_tensors=0):
    """A GGUF file (or the parts of a split one), tensors written one at a time."""
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, value in meta:
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, kind, data in tensors:
        raw = None if kind == "F32" else GGMLQuantizationType[kind]
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, data in tensors:
        w.write_tensor_data(data.make() if isinstance(data, Lazy) else data)
    w.close()


class Lazy:
    """Tensor bytes made only when written (random blocks of a large file, one tensor in memory at a time)."""

    def __init__(self, shape: tuple[int, ...], make):
        self.shape, self.dtype, self.nbytes, self.make = shape, np.dtype(np.uint8), int(np.prod(shape)), make


def gguf_tensors(path):
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


def stored_blob(out: str, key: str) -> np.ndarray:
    info = open_checkpoint(out).tensors[key]
    with open(info.path, "rb") as f:
        f.seek(info.offset)
        return np.frombuffer(f.read(info.nbytes), dtype=np.uint8)


def gguf_values(data: np.ndarray, kind) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(np.array(data), kind))


def greedy_logits_of(model_dir, max_new_tokens=8, **kwargs):
    return greedy_run(model_dir, PROMPT, max_new_tokens, **kwargs)


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}
PERMUTED = {"mixtral"}  # llama.cpp's LlamaModel permutes attn_q/attn_k rows; Qwen2/3 MoE and OLMoE it does not


# ------------------------------------------------------------------------------------- writing GGUFs like llama.cpp


def llama_cpp_metadata(arch: str, cfg: dict) -> list:
    """The keys llama.cpp's converter writes for these architectures."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    meta = [
        (f"{arch}.block_count", cfg["num_hidden_layers"]),
        (f"{arch}.context_length", cfg["max_position_embeddings"]),
        (f"{arch}.embedding_length", cfg["hidden_size"]),
        (f"{arch}.feed_forward_length", cfg["intermediate_size"]),
        (f"{arch}.attention.head_count", cfg["num_attention_heads"]),
        (f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"]),
        (f"{arch}.rope.freq_base", float(cfg["rope_parameters"]["rope_theta"])),
        (f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"])),
        (f"{arch}.expert_count", experts),
        (f"{arch}.expert_used_count", cfg["num_experts_per_tok"]),
        (f"{arch}.attention.key_length", cfg["head_dim"]),
        (f"{arch}.attention.value_length", cfg["head_dim"]),
        ("general.file_type", 15),
    ]
    if "moe_intermediate_size" in cfg:
        meta.append((f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"]))
    if "shared_expert_intermediate_size" in cfg:
        meta.append((f"{arch}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"]))
    if arch == "llama":
        meta += [("llama.vocab_size", cfg["vocab_size"]), ("llama.rope.dimension_count", cfg["head_dim"])]
    return meta


def permute_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter for LLaMA-style rope: row (head, half, i) of each head goes to (head, i, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_cpp_tensors(src: str, arch: str, cfg: dict, expert_type, dense_type: str):
    """(name, GGML type, data) as llama.cpp writes them: experts stacked per layer and projection."""
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), cfg["num_hidden_layers"])
    ckpt = open_checkpoint(src)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out = []
    for key in sorted(ckpt.tensors):
        info = ckpt.tensors[key]
        with safe_open(info.path, "pt") as f:
            w = f.get_tensor(key)
        base, suffix = key.rsplit(".", 1)
        expert = None
        parts = base.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            expert = int(parts.pop(parts.index("experts") + 1))
        name = f"{names.get_name('.'.join(parts))}.{suffix}"
        if expert is not None:
            stacks.setdefault(name, {})[expert] = w
            continue
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in key else cfg["num_key_value_heads"]
            w = permute_heads(w, heads)
        if name.endswith(".ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # (1, hidden) in transformers; llama.cpp's tensor is (hidden)
        if w.dim() == 1 or "ffn_gate_inp" in name:  # llama.cpp keeps these F32
            out.append((name, "F32", w.float().numpy()))
        else:
            kind = dense_type(name) if callable(dense_type) else dense_type
            out.append((name, kind, encode(w, kind, 0)))
    for name, experts in sorted(stacks.items()):
        layer, proj = int(name.split(".")[1]), name.split(".")[2].split("_")[1]
        kind = expert_type(layer, proj)
        blocks = [encode(experts[e], kind, seed=hash((name, e)) % 2**32) for e in range(len(experts))]
        out.append((name, kind, np.stack(blocks)))
    return out


def gguf_from(src: str, path, expert_type, dense_type="BF16", split_max_tensors=0, drop=(), drop_tensors=()):
    cfg = json.load(open(os.path.join(src, "config.json")))
    arch = GGUF_ARCH[cfg["model_type"]]
    meta = [
        (k, v) for k, v in [*llama_cpp_metadata(arch, cfg), *tokenizer_meta(src, cfg["vocab_size"])] if k not in drop
    ]
    tensors = [t for t in llama_cpp_tensors(src, arch, cfg, expert_type, dense_type) if t[0] not in drop_tensors]
    write_gguf(path, arch, meta, tensors, split_max_tensors)
    return str(path)
