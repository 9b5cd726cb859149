"""GGUF files written the way llama.cpp's converter lays them out, and what the import tests read back: shared by
tests/test_gguf_import.py and tests/test_gguf_import_families.py."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

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
