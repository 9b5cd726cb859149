"""`weightstream import`: GGUF files written here the way llama.cpp's converter lays them out (its tensor names,
its metadata keys, its q/k row permutation for LLaMA-style rope, experts stacked (experts, out, in) in GGML
blocks) from tiny synthetic checkpoints, imported and checked: expert bytes kept bit for bit, streamed equal to
resident, dense weights equal to the source, logits close to the source with the same experts, bad files refused
naming the fault with nothing left behind, and the command as a user runs it."""

import json
import os
import pty
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from safetensors import safe_open

from weightstream import native
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.gguf_import import import_gguf
from weightstream.store.presets import preset_config
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.manifest import BLOCK_TYPES, blob_key, read_manifest
from weightstream.store.synth import synthesize

from cli_support import ran_in_process
from gguf_support import (
    GGUF_ARCH,
    PERMUTED,
    PROMPT,
    Lazy,
    built_once,
    gguf_from,
    gguf_tensors,
    gguf_values,
    greedy_logits_of,
    importer,
    permute_heads,
    stored_blob,
    write_gguf,
)
from rss_support import peak_over_baseline

WIDE = {"hidden_size": 256, "head_dim": 64}  # whole Q4_K super-blocks of 256 on every expert input
SIZES = {
    "qwen3_moe": {**WIDE, "moe_intermediate_size": 256, "norm_topk_prob": True},  # as Qwen3 MoE models and llama.cpp
    "qwen2_moe": {**WIDE, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 128},
    "olmoe": {**WIDE, "intermediate_size": 256},
    "mixtral": {**WIDE, "intermediate_size": 256},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    def make(arch: str) -> str:
        out = str(tmp_path_factory.mktemp(f"src-{arch}") / "model")
        synthesize(out, {**preset_config("tiny", arch), **SIZES[arch]}, dtype="bf16", seed=1)
        return out

    return built_once(make)


def mixed(layer: int, proj: str) -> str:
    """Every block type the kernels run, and layers that differ: a Q4_K_M-like file."""
    return {0: {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}, 1: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}}.get(
        layer, {"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"}
    )[proj]


def lowbit(layer: int, proj: str) -> str:
    """A Q2_K / Q3_K_M-like file: every low-bit K type, layers that differ."""
    return {0: {"gate": "Q2_K", "up": "Q2_K", "down": "Q3_K"}, 1: {"gate": "Q5_K", "up": "Q5_K", "down": "Q6_K"}}.get(
        layer, {"gate": "Q3_K", "up": "Q3_K", "down": "Q2_K"}
    )[proj]


# RECIPES: name -> (architecture, expert types, dense types)
RECIPES = {
    "olmoe-lowbit": ("olmoe", lowbit, "BF16"),
    "qwen3-mixed": ("qwen3_moe", mixed, "BF16"),
    "qwen2-q8": (
        "qwen2_moe",
        lambda layer, proj: "Q8_0",
        lambda name: "Q8_0" if name == "token_embd.weight" else "BF16",
    ),
    "olmoe-q4_0": ("olmoe", lambda layer, proj: "Q4_0", "BF16"),
    "mixtral-q4_1": ("mixtral", lambda layer, proj: "Q8_0" if proj == "down" else "Q4_1", "BF16"),
}
# dense weights quantized as llama.cpp's Q4_K_M does (GGUF name -> type; the rest BF16, router and norms F32): each
# type the kernels run on an attention, shared-expert or head weight, a quantized embedding (a lookup: dequantized)
# and a type the kernels do not run (dequantized, as before)
DENSE_TYPES = {
    "mixtral-dense-blocks": {
        "attn_q": "Q4_K",
        "attn_k": "Q6_K",
        "attn_v": "Q8_0",
        "attn_output": "Q4_K",
        "output": "Q6_K",
        "token_embd": "Q8_0",
    },
    "qwen2-dense-blocks": {
        "attn_q": "Q8_0",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q4_1",
        "ffn_gate_shexp": "Q4_K",
        "ffn_up_shexp": "Q4_0",
        "ffn_down_shexp": "IQ4_NL",
        "output": "Q4_K",
    },
    "olmoe-lowbit-dense": {
        "attn_q": "Q2_K",
        "attn_k": "Q3_K",
        "attn_v": "Q5_K",
        "attn_output": "Q3_K",
        "output": "Q5_K",
    },
}
DENSE_RECIPES = {
    "mixtral-dense-blocks": ("mixtral", lambda layer, proj: "Q4_K", DENSE_TYPES["mixtral-dense-blocks"]),
    "qwen2-dense-blocks": ("qwen2_moe", lambda layer, proj: "Q8_0", DENSE_TYPES["qwen2-dense-blocks"]),
    "olmoe-lowbit-dense": ("olmoe", lowbit, DENSE_TYPES["olmoe-lowbit-dense"]),
}


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    """imported(recipe) -> (gguf path, imported directory), built once; imported.results[recipe]: its
    ImportResult."""

    def gguf_of(recipe: str, tmp) -> str:
        arch, experts, dense = {**RECIPES, **DENSE_RECIPES}[recipe]
        if isinstance(dense, dict):
            dense = lambda name, types=dense: types.get(name.split(".")[-2], "BF16")  # noqa: E731
        return gguf_from(source(arch), tmp / f"{recipe}.gguf", experts, dense)

    return importer(tmp_path_factory, gguf_of)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_expert_is_the_ggufs_blocks_bit_for_bit(imported, recipe):
    """Lossless: each blob tensor's bytes are the GGUF slice's, and the native decoder reads them as gguf's does."""
    assert native.available(), native.why_not()  # loads the extension, registering its ops
    path, out = imported(recipe)
    fmt, tensors = read_manifest(out), gguf_tensors(path)
    assert (
        fmt.scheme
        == {
            "qwen3-mixed": "q4_k",
            "qwen2-q8": "q8_0",
            "olmoe-q4_0": "q4_1",
            "mixtral-q4_1": "q4_1",
            "olmoe-lowbit": "q4_k",
        }[recipe]
    )
    layers = sorted({int(n.split(".")[1]) for n in tensors if "_exps" in n})
    for layer in layers:
        table, blob_bytes = fmt.table(layer)
        gate, up, down = (tensors[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        for e in range(gate.data.shape[0]):
            blob = stored_blob(out, blob_key(f"model.layers.{layer}.mlp.experts", e))
            assert blob.size == blob_bytes
            for t, parts in zip(table, ((gate, up), (down,)), strict=True):
                stored = blob[t.offset : t.offset + t.nbytes]
                assert t.dtype == parts[0].tensor_type.name
                assert np.array_equal(stored, np.concatenate([p.data[e].reshape(-1) for p in parts]))
                want = torch.cat([gguf_values(p.data[e], p.tensor_type) for p in parts])
                got = native.dequantize(torch.from_numpy(stored.copy()), t.dtype, *t.shape)
                assert torch.equal(got, want), (layer, e, t.name)
    if recipe == "qwen3-mixed":  # Q4_K_M-like: a Q6_K layer and a Q4_0/Q8_0 layer keep their own tables
        assert sorted(fmt.layer_tables) == [1, 2] and fmt.table(1)[0][1].dtype == "Q6_K"
    if recipe == "olmoe-q4_0":  # every layer alike: one table, the file's own type (the load-time check encodes it)
        assert [t.dtype for t in fmt.tensors] == ["Q4_0", "Q4_0"] and not fmt.layer_tables


@pytest.mark.parametrize("recipe", sorted(RECIPES) + sorted(DENSE_RECIPES))
def test_streamed_logits_equal_resident_bitwise(imported, recipe):
    """Every cache size and I/O thread count for the Q4_K_M-like file; one small cache for the others."""
    _, out = imported(recipe)
    tokens, logits, runtime = greedy_logits_of(out, expert_cache="100x", io_threads=2)
    assert all(k.endswith("-native") for k in runtime.kernels.values()), runtime.kernels
    grid = [(s, t) for s in ("1x", "1.5x", "4x") for t in (1, 2, 8)] if recipe == "qwen3-mixed" else [("1x", 8)]
    for size, threads in grid:
        got_tokens, got_logits, _ = greedy_logits_of(out, expert_cache=size, io_threads=threads)
        assert got_tokens == tokens, (recipe, size, threads)
        assert all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True)), (recipe, size, threads)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dense_weights_equal_the_source_and_logits_follow_the_same_experts(imported, source, recipe):
    """Dense weights are the source's (q/k rows put back for Mixtral; the Q8_0 embedding of qwen2-q8 is its
    dequantized values), and the logits are those of the source model given the GGUF's experts, dequantized, up
    to the kernels' 8-bit activations."""
    from transformers import AutoModelForCausalLM

    path, out = imported(recipe)
    arch = RECIPES[recipe][0]
    src, tensors = source(arch), gguf_tensors(path)
    src_ckpt, out_ckpt = open_checkpoint(src).tensors, open_checkpoint(out).tensors
    dense = sorted(k for k in out_ckpt if not k.endswith(".packed"))
    assert dense == sorted(k for k in src_ckpt if ".experts." not in k)
    for key in dense:
        with safe_open(out_ckpt[key].path, "pt") as f:
            got = f.get_tensor(key)
        with safe_open(src_ckpt[key].path, "pt") as f:
            want = f.get_tensor(key)
        if recipe == "qwen2-q8" and key == "model.embed_tokens.weight":
            t = tensors["token_embd.weight"]
            assert not torch.equal(got, want)  # the file's values, not the source's
            want = gguf_values(t.data, t.tensor_type).reshape(want.shape).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), key
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in range(reference.config.num_hidden_layers):
            experts = reference.model.layers[layer].mlp.experts
            gate, up, down = (tensors[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
            for e in range(experts.num_experts):
                deq = [gguf_values(t.data[e], t.tensor_type).to(torch.bfloat16) for t in (gate, up, down)]
                experts.gate_up_proj[e].copy_(torch.cat(deq[:2]))
                experts.down_proj[e].copy_(deq[2])
        want = reference(PROMPT).logits[0].float()
    model = load_streaming_model(out, expert_cache="4x")
    try:
        with torch.inference_mode():
            got = model(PROMPT).logits[0].float()
    finally:
        model.weightstream.close()
    error = float((got - want).abs().max() / want.abs().max())
    assert error < 0.03, error  # measured 0.6-1.7% (8-bit activations in the native kernels)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _source_names(src: str) -> dict[str, str]:
    """Checkpoint key -> GGUF tensor name of every dense tensor of a source checkpoint."""
    cfg = json.load(open(os.path.join(src, "config.json")))
    arch = GGUF_ARCH[cfg["model_type"]]
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), cfg["num_hidden_layers"])
    out = {}
    for key in open_checkpoint(src).tensors:
        if ".experts." not in key:
            base, suffix = key.rsplit(".", 1)
            out[key] = f"{names.get_name(base)}.{suffix}"
    return out


def _unpermuted(rows: torch.Tensor, key: str, cfg: dict) -> torch.Tensor:
    """The rows (floats or bytes) of a GGUF tensor in transformers' order: for Mixtral's q/k, the file's row p is
    the source's row permute_heads(arange)[p]; any other tensor is in order already."""
    if cfg["model_type"] not in PERMUTED or not key.endswith(("q_proj.weight", "k_proj.weight")):
        return rows
    heads = cfg["num_attention_heads"] if "q_proj" in key else cfg["num_key_value_heads"]
    out = torch.empty_like(rows)
    out[permute_heads(torch.arange(rows.shape[0]), heads)] = rows
    return out


def _stored(out: str, key: str) -> torch.Tensor:
    info = open_checkpoint(out).tensors[key]
    with safe_open(info.path, "pt") as f:
        return f.get_tensor(key)


@pytest.mark.parametrize("recipe", sorted(DENSE_RECIPES))
def test_dense_linear_weights_keep_the_ggufs_blocks_and_load_as_native_linear(imported, source, recipe):
    """Every dense linear weight of a type the kernels run (attention, shared expert, head) is the file's blocks
    byte for byte (Mixtral's q/k: the file's rows of bytes moved back whole), listed in the manifest's dense table,
    and loads as NativeLinear. The quantized embedding (a lookup) and the IQ4_NL weight (a type the kernels do not
    run) are dequantized as before, each said with its reason; the router and norms stay float."""
    from weightstream.engine.kernels.dense import NativeLinear, StoredEmbedding

    path, out = imported(recipe)
    src = source(DENSE_RECIPES[recipe][0])
    cfg = json.load(open(os.path.join(src, "config.json")))
    tensors, fmt, names = gguf_tensors(path), read_manifest(out), _source_names(src)
    kept = {k: n for k, n in names.items() if tensors[n].tensor_type.name in BLOCK_TYPES and "token_embd" not in n}
    assert sorted(fmt.dense) == sorted(kept)
    for key, name in kept.items():
        t = tensors[name]
        assert fmt.dense[key] == (t.tensor_type.name, (int(t.shape[1]), int(t.shape[0])))  # GGUF lists (in, out)
        got = _stored(out, key)
        assert got.dtype == torch.uint8 and torch.equal(got, _unpermuted(torch.from_numpy(t.data.copy()), key, cfg))
    result = imported.results[recipe]
    assert result.dense_blocks == dict(Counter(tensors[n].tensor_type.name for n in kept.values()))
    floats = {k: n for k, n in names.items() if k not in kept}
    for key, name in floats.items():
        t = tensors[name]
        got = _stored(out, key)
        want = _unpermuted(gguf_values(t.data, t.tensor_type).reshape(got.shape[0], -1), key, cfg).reshape(got.shape)
        assert torch.equal(got, want.to(torch.bfloat16)), key
    dequantized = {
        "mixtral-dense-blocks": "1 Q8_0 tensor(s) dequantized to bfloat16 (token_embd.weight): the token embedding "
        "is a row lookup",
        "qwen2-dense-blocks": "3 IQ4_NL tensor(s) dequantized to bfloat16 (blk.0.ffn_down_shexp.weight, "
        "blk.1.ffn_down_shexp.weight, blk.2.ffn_down_shexp.weight): the native kernels do not run IQ4_NL",
    }.get(recipe)
    if dequantized is None:  # every quantized dense weight kept as blocks
        assert not any("dequantized" in line for line in result.notes), result.notes
    else:
        assert any(dequantized in line for line in result.notes), result.notes
    model = load_streaming_model(out, expert_cache="1x")
    try:
        linears = {f"{p}.weight": m for p, m in model.named_modules() if isinstance(m, NativeLinear)}
        assert sorted(linears) == sorted(kept)  # these architectures' parameter names are their checkpoint keys
        assert all(m.wtype == fmt.dense[key][0] for key, m in linears.items())
        embedding = model.get_input_embeddings()  # kept as stored, its rows converted to the compute dtype
        assert isinstance(embedding, StoredEmbedding) and embedding.weight.dtype == torch.bfloat16
        assert model.dtype == fmt.compute_dtype == torch.float32
        assert not [n for n, m in model.named_modules() if n.endswith(".gate") and isinstance(m, NativeLinear)]
    finally:
        model.weightstream.close()


def test_permuted_q_k_blocks_dequantize_to_the_permuted_float_weight(imported, source):
    """Mixtral's q/k rows moved back as rows of blocks: the stored blocks decode to exactly the file's decoded
    values with the rows put back (what the float path stores, less the bf16 rounding), and they are the source's
    rows encoded in transformers' order (the file encoded the permuted rows one by one)."""
    path, out = imported("mixtral-dense-blocks")
    src = source("mixtral")
    cfg = json.load(open(os.path.join(src, "config.json")))
    tensors, src_ckpt = gguf_tensors(path), open_checkpoint(src).tensors
    for layer in range(cfg["num_hidden_layers"]):
        for proj in ("q", "k"):
            key, t = f"model.layers.{layer}.self_attn.{proj}_proj.weight", tensors[f"blk.{layer}.attn_{proj}.weight"]
            wtype, (n, k) = t.tensor_type.name, (int(t.shape[1]), int(t.shape[0]))
            stored = _stored(out, key)
            floats = gguf_values(t.data, t.tensor_type).reshape(n, k)  # the file's values in its (permuted) row order
            want = _unpermuted(floats, key, cfg)
            assert not torch.equal(want, floats)  # the rows did move
            assert torch.equal(native.dequantize(stored, wtype, n, k), want), key
            with safe_open(src_ckpt[key].path, "pt") as f:
                assert torch.equal(stored, ENCODERS[wtype](f.get_tensor(key).float())), key


class _Dequantized(torch.nn.Module):
    """A float Linear in NativeLinear's place: the weight given, the bias added after the product as NativeLinear
    adds it (not fused into the product as torch.nn.Linear's addmm does)."""

    def __init__(self, weight: torch.Tensor, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


LONG_PROMPT = (torch.arange(24) * 37 + 3).remainder(512).reshape(1, -1)  # >= NATIVE_DEQUANT_ROWS rows


@pytest.mark.parametrize("recipe", sorted(DENSE_RECIPES))
def test_block_dense_logits_equal_those_of_the_dequantized_blocks(imported, source, recipe):
    """The imported model against itself with every NativeLinear replaced by a float weight: gguf's decoding of
    the file's blocks (q/k rows put back), in the dtype the model computes in. Where the CPU has no multi-row tiles,
    a 24-row prefill multiplies the blocks dequantized once (NATIVE_DEQUANT_ROWS), so its logits are those of the
    reference bit for bit; with tiles it runs the native products as decoding does. Native products (int8
    activations against the blocks) give logits within 3%, and the same greedy tokens up to a near-tie (the
    reference's two best nearer than the two runs differ: measured 0.006 apart against 0.012 at step 7 of mixtral)."""
    from weightstream.engine.kernels.dense import NativeLinear
    from weightstream.engine.kernels.quantized import NATIVE_DEQUANT_ROWS, native_dequant_rows

    assert LONG_PROMPT.shape[1] >= NATIVE_DEQUANT_ROWS
    path, out = imported(recipe)
    cfg = json.load(open(os.path.join(source(DENSE_RECIPES[recipe][0]), "config.json")))
    tensors, names = gguf_tensors(path), _source_names(source(DENSE_RECIPES[recipe][0]))
    runs = []
    for reference in (False, True):
        model = load_streaming_model(out, expert_cache="4x")
        try:
            linears = {p: m for p, m in model.named_modules() if isinstance(m, NativeLinear)}
            assert len(linears) == len(read_manifest(out).dense) > 0
            dequantized_prefill = native_dequant_rows([m.wtype for m in linears.values()]) <= LONG_PROMPT.shape[1]
            for p, m in linears.items() if reference else ():
                t = tensors[names[f"{p}.weight"]]
                weight = _unpermuted(gguf_values(t.data, t.tensor_type).reshape(m.out_features, -1), f"{p}.weight", cfg)
                parent, _, attr = p.rpartition(".")
                setattr(model.get_submodule(parent), attr, _Dequantized(weight.to(model.dtype), m.bias))
            assert model.dtype == read_manifest(out).compute_dtype
            assert reference or not isinstance(model.model.layers[0].self_attn.q_proj, _Dequantized)
            with torch.inference_mode():
                prefill = model(LONG_PROMPT).logits[0]
                gen = model.generate(
                    PROMPT, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
                )
            runs.append((prefill, gen.sequences[0].tolist(), [g[0].float() for g in gen.logits]))
        finally:
            model.weightstream.close()
    (prefill, tokens, logits), (want_prefill, want_tokens, want_logits) = runs
    if dequantized_prefill:
        assert torch.equal(prefill, want_prefill)
    else:
        # int8 activations at every position: about 1% typically; one position of mixtral's 24 measured 11% (its
        # rows meet the blocks as decoding does, where one step is within 3%)
        per_position = (prefill - want_prefill).abs().amax(-1) / want_prefill.abs().amax(-1)
        assert float(per_position.median()) < 0.02 and float(per_position.max()) < 0.15, per_position.tolist()
    for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        assert float((got - want).abs().max() / want.abs().max()) < 0.03
        if tokens[PROMPT.shape[1] + step] != want_tokens[PROMPT.shape[1] + step]:
            # only where the reference's two best are nearer than the products differ; after it, the inputs differ
            best = want.topk(2).values
            assert float(best[0] - best[1]) <= 2 * float((got - want).abs().max()), step
            break


def test_dense_blocks_do_not_vote_for_the_activation_dtype(source, tmp_path):
    """Every dense weight a block type the kernels run, the embedding F32: nothing stored as floats needs bf16, so
    the model computes in float32 (the F32 embedding kept exactly) and NativeLinear takes float32 activations. Were
    the blocks counted, the file would have been bf16 as before. (Q8_0 experts: in float32, the load-time check of
    Q4_K and Q6_K experts measures 3.1-3.2% on these shapes, over its 3%, for any float32 import, as before.)"""
    src = source("mixtral")
    types = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q4_K", "output": "Q6_K"}
    path = gguf_from(
        src, tmp_path / "f32.gguf", lambda layer, proj: "Q8_0", lambda name: types.get(name.split(".")[-2], "F32")
    )
    result = import_gguf(path, str(tmp_path / "out"), log=lambda line: None)
    out = str(tmp_path / "out")
    assert result.activation_dtype == "float32" and read_manifest(out).activation_dtype == "float32"
    assert result.dense_blocks == {"Q4_K": 6, "Q6_K": 4, "Q8_0": 3}
    with safe_open(open_checkpoint(src).tensors["model.embed_tokens.weight"].path, "pt") as f:
        assert torch.equal(_stored(out, "model.embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight").float())
    tokens, logits, _ = greedy_logits_of(out, max_new_tokens=2, expert_cache="1x")
    assert len(tokens) == PROMPT.shape[1] + 2 and logits[0].dtype == torch.float32


def test_an_import_whose_dense_weights_are_blocks_says_it_needs_the_native_kernels(imported):
    _, out = imported("qwen2-dense-blocks")
    run = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "generate", out, "--prompt-ids", "1,2", "--max-new-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WEIGHTSTREAM_NATIVE": "0"},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert (
        f"{out}: its dense weights are GGML blocks, which need weightstream's native kernels (WEIGHTSTREAM_NATIVE=0); "
        "`weightstream import` keeps qwen2-dense-blocks.gguf's blocks as they are" in run.stderr
    ), run.stderr


def test_float_experts_make_a_plain_checkpoint_equal_to_the_source(source, tmp_path):
    """BF16 experts are not quantized: per-expert safetensors in the architecture's layout, no manifest, the
    source's bytes, and the source's logits bit for bit."""
    src = source("mixtral")
    path = gguf_from(src, tmp_path / "bf16.gguf", lambda layer, proj: "BF16")
    result = import_gguf(path, str(tmp_path / "out"), log=lambda line: None)
    out = str(tmp_path / "out")
    assert result.scheme is None and read_manifest(out) is None and result.expert_types == {"BF16": 9}
    src_ckpt, out_ckpt = open_checkpoint(src).tensors, open_checkpoint(out).tensors
    assert sorted(out_ckpt) == sorted(src_ckpt)
    for key, info in out_ckpt.items():
        with safe_open(info.path, "pt") as f, safe_open(src_ckpt[key].path, "pt") as g:
            assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key
    tokens, logits, _ = greedy_logits_of(src, max_new_tokens=4, expert_cache="1x")
    got_tokens, got_logits, _ = greedy_logits_of(out, max_new_tokens=4, expert_cache="1x")
    assert got_tokens == tokens and all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True))


def test_types_the_kernels_do_not_run_are_requantized_with_the_error_said(source, tmp_path):
    """F16 inside a quantized file (16 bits a weight) -> Q8_0, IQ4_NL (4.5) -> Q4_K: the bytes are the encoders' of
    gguf's decoded values, and the error against those values is measured and said."""
    path = gguf_from(
        source("qwen3_moe"), tmp_path / "q5.gguf", lambda layer, proj: "IQ4_NL" if proj == "down" else "F16"
    )
    notes = []
    result = import_gguf(path, str(tmp_path / "out"), log=notes.append)
    fmt, tensors = read_manifest(str(tmp_path / "out")), gguf_tensors(path)
    assert fmt.scheme == "q4_k" and [t.dtype for t in fmt.tensors] == ["Q8_0", "Q4_K"] and not fmt.layer_tables
    by_type = {r["from"]: r for r in result.requantized}
    assert {(r["from"], r["to"], r["tensors"]) for r in result.requantized} == {
        ("IQ4_NL", "Q4_K", 3),
        ("F16", "Q8_0", 6),
    }
    sse = {"F16": 0.0, "IQ4_NL": 0.0}
    ssr = dict.fromkeys(sse, 0.0)
    for layer in range(3):
        for e in range(8):
            blob = stored_blob(str(tmp_path / "out"), blob_key(f"model.layers.{layer}.mlp.experts", e))
            for t, projs in zip(fmt.tensors, (("gate", "up"), ("down",)), strict=True):
                src = [tensors[f"blk.{layer}.ffn_{p}_exps.weight"] for p in projs]
                values = torch.cat([gguf_values(s.data[e], s.tensor_type) for s in src])
                encoded = ENCODERS[t.dtype](values).numpy().reshape(-1)
                assert np.array_equal(blob[t.offset : t.offset + t.nbytes], encoded)
                back = gguf_values(encoded.reshape(values.shape[0], -1), GGMLQuantizationType[t.dtype])
                kind = src[0].tensor_type.name
                sse[kind] += float((back.double() - values.double()).pow(2).sum())
                ssr[kind] += float(values.double().pow(2).sum())
    for kind in sse:
        assert by_type[kind]["rel_rms"] == pytest.approx((sse[kind] / ssr[kind]) ** 0.5, rel=1e-6)
        assert any(f"{kind} tensor(s) requantized to {by_type[kind]['to']}" in line for line in notes), notes
    assert 0.001 < by_type["F16"]["rel_rms"] < 0.01 and 0.02 < by_type["IQ4_NL"]["rel_rms"] < 0.15
    tokens, _, runtime = greedy_logits_of(str(tmp_path / "out"), max_new_tokens=2, expert_cache="1x")
    assert len(tokens) == PROMPT.shape[1] + 2 and runtime.kernels == {"Qwen3MoeExperts": "q4_k-native"}
    result = import_gguf(path, str(tmp_path / "q8"), requantize="q8_0", log=lambda line: None)
    assert [t.dtype for t in read_manifest(str(tmp_path / "q8")).tensors] == ["Q8_0", "Q8_0"]
    assert {r["from"]: r["to"] for r in result.requantized} == {"IQ4_NL": "Q8_0", "F16": "Q8_0"}


def test_a_split_gguf_imports_as_the_single_file_does(imported, source, tmp_path):
    single = imported("qwen3-mixed")[1]
    first = gguf_from(source("qwen3_moe"), tmp_path / "m.gguf", mixed, split_max_tensors=12)
    parts = sorted(p for p in os.listdir(tmp_path) if p.endswith(".gguf"))
    assert parts == ["m-00001-of-00004.gguf", "m-00002-of-00004.gguf", "m-00003-of-00004.gguf", "m-00004-of-00004.gguf"]
    assert not os.path.exists(first)
    import_gguf(str(tmp_path / parts[2]), str(tmp_path / "out"), log=lambda line: None)  # any part names the model
    assert read_manifest(str(tmp_path / "out")).tables() == read_manifest(single).tables()
    a, b = open_checkpoint(single).tensors, open_checkpoint(str(tmp_path / "out")).tensors
    assert sorted(a) == sorted(b)
    for key in a:
        with safe_open(a[key].path, "pt") as f, safe_open(b[key].path, "pt") as g:
            assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key
    os.remove(tmp_path / parts[3])
    with pytest.raises(WeightstreamError, match=r"part 1 of a 4-part GGUF; missing beside it: m-00004-of-00004\.gguf"):
        import_gguf(str(tmp_path / parts[0]), str(tmp_path / "out2"))


def test_the_tokenizer_and_config_come_from_the_metadata(imported, source):
    from transformers import AutoConfig, AutoTokenizer

    from weightstream.store.tokenizer import CORPUS

    for recipe in RECIPES:
        arch = RECIPES[recipe][0]
        want_tok, got_tok = (
            AutoTokenizer.from_pretrained(source(arch)),
            AutoTokenizer.from_pretrained(imported(recipe)[1]),
        )
        assert len(got_tok) == len(want_tok) == 512  # no tokenizer-class default (<|endoftext|>) past the vocabulary
        for text in (CORPUS, "Hello, world! <|eos|> 10 + 32 = 42\n\tünïcode 😀", "  two  spaces"):
            assert got_tok(text).input_ids == want_tok(text).input_ids, (recipe, text)
        assert (got_tok.bos_token, got_tok.eos_token, got_tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
        want, got = AutoConfig.from_pretrained(source(arch)), AutoConfig.from_pretrained(imported(recipe)[1])
        for name in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "rope_parameters",
            "max_position_embeddings",
            "num_experts_per_tok",
            "num_experts",
            "num_local_experts",
            "moe_intermediate_size",
            "intermediate_size",
            "norm_topk_prob",
            "shared_expert_intermediate_size",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            if name == "intermediate_size" and arch in ("qwen3_moe", "qwen2_moe"):
                continue  # the dense MLP width: no dense layer, nothing to import it for
            assert getattr(got, name, None) == getattr(want, name, None), (recipe, name)


def _patched(src: str, dst, at: int | None = None, data: bytes = b"", size: int | None = None) -> str:
    raw = bytearray(open(src, "rb").read())
    if at is not None:
        raw[at : at + len(data)] = data
    open(dst, "wb").write(bytes(raw[:size]))
    return str(dst)


def _offset_field(path: str, name: str) -> int:
    """Byte position of a tensor's data offset in its tensor info: name, dims count, dims, type, offset."""
    raw = open(path, "rb").read()
    pos = raw.index(name.encode()) + len(name)
    (dims,) = np.frombuffer(raw[pos : pos + 4], dtype="<u4")
    return pos + 4 + 8 * int(dims) + 4


def test_bad_files_are_refused_naming_the_fault_and_nothing_is_left(imported, source, tmp_path):
    good = imported("qwen3-mixed")[0]
    size = os.path.getsize(good)
    src = source("qwen3_moe")
    down = "blk.2.ffn_down_exps.weight"
    mismatched = {"gate": "Q8_0", "up": "Q4_0", "down": "Q8_0"}
    cases = [
        (_patched(good, tmp_path / "empty.gguf", size=0), "not a GGUF file (it is empty)"),
        (_patched(good, tmp_path / "magic.gguf", 0, b"GGML"), "not a GGUF file (it starts with b'GGML', not b'GGUF')"),
        (_patched(good, tmp_path / "v99.gguf", 4, (99).to_bytes(4, "little")), "GGUF version 99; this importer reads"),
        (_patched(good, tmp_path / "cut.gguf", size=size * 2 // 3), "runs past the end of the file"),
        (_patched(good, tmp_path / "header.gguf", size=600), "the GGUF header is damaged or cut short"),
        (
            _patched(good, tmp_path / "offset.gguf", _offset_field(good, down), (2**40).to_bytes(8, "little")),
            f"tensor '{down}': its data (bytes 10995116",  # 2**40 past the data section's start
        ),
        (
            _patched(good, tmp_path / "type.gguf", _offset_field(good, down) - 4, (99).to_bytes(4, "little")),
            f"tensor '{down}' has GGML type id 99, unknown to the gguf package here",
        ),
        (
            gguf_from(src, tmp_path / "nokey.gguf", mixed, drop=("qwen3moe.expert_count",)),
            "metadata key 'qwen3moe.expert_count' is missing (routed experts per layer)",
        ),
        (
            gguf_from(src, tmp_path / "notensor.gguf", mixed, drop_tensors=("blk.1.attn_k_norm.weight",)),
            "tensor 'blk.1.attn_k_norm.weight' (model.layers.1.self_attn.k_norm.weight of qwen3_moe) is missing",
        ),
        (
            gguf_from(src, tmp_path / "gateup.gguf", lambda layer, proj: mismatched[proj]),
            "'blk.0.ffn_gate_exps.weight' is Q8_0 and 'blk.0.ffn_up_exps.weight' is Q4_0",
        ),
        (
            _retagged(good, tmp_path / "phimoe.gguf", "phimoe"),
            "architecture 'phimoe'; weightstream streams Mixture-of-Experts models and imports these GGUF "
            "architectures: qwen3moe, qwen2moe, olmoe, llama with experts (Mixtral)",
        ),
        (str(tmp_path), "is a directory; pass a .gguf file"),
    ]
    for path, message in cases:
        out = tmp_path / "out"
        with pytest.raises(WeightstreamError) as err:
            import_gguf(path, str(out), log=lambda line: None)
        assert message in str(err.value) and str(err.value).startswith(path), (path, str(err.value))
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")], path
    # a dense llama file: refused as such
    write_gguf(
        tmp_path / "dense.gguf",
        "llama",
        [("llama.block_count", 1)],
        [("token_embd.weight", "F32", np.zeros((4, 8), np.float32))],
    )
    with pytest.raises(WeightstreamError, match="a dense llama model \\(no experts\\)"):
        import_gguf(str(tmp_path / "dense.gguf"), str(tmp_path / "out"))


def _retagged(src: str, dst, arch: str) -> str:
    """The same file with another general.architecture (same length: 'qwen3moe' -> 'phimoe\\0\\0' does not parse)."""
    from gguf import GGUFReader

    reader = GGUFReader(src)
    meta = [(k, f.contents()) for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general.architecture"))]
    meta = [(k.replace("qwen3moe.", f"{arch}."), v) for k, v in meta]
    tensors = [(t.name, t.tensor_type.name, np.array(t.data)) for t in reader.tensors]
    write_gguf(dst, arch, meta, tensors)
    return str(dst)


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _cli_on_a_terminal(*args, timeout=300) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (the progress display shows only there): rc, stdout, stderr."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightstream.cli", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "160"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout = proc.stdout.read().decode()
    return proc.wait(timeout=timeout), stdout, b"".join(chunks).decode(errors="replace")


def test_the_command_imports_says_what_is_lossy_and_shows_progress(source, tmp_path):
    path = gguf_from(
        source("olmoe"), tmp_path / "olmoe.gguf", lambda layer, proj: "IQ4_NL" if proj == "down" else "Q4_K"
    )
    out = tmp_path / "olmoe"
    rc, stdout, stderr = _cli_on_a_terminal("import", path, "--out", str(out), "--json")
    assert rc == 0, stderr
    summary = json.loads(stdout)
    assert summary["scheme"] == "q4_k" and summary["model_type"] == "olmoe" and summary["experts"] == 24
    assert summary["expert_types"] == {"Q4_K": 9} and summary["requantized"][0]["from"] == "IQ4_NL"
    assert f"importing {path}" in stderr  # the progress display
    assert (
        "weightstream import: experts: 3 IQ4_NL tensor(s) requantized to Q4_K (the native kernels do not run IQ4_NL)"
        in (stderr.replace("\r\n", "\n"))
    )
    run = _cli("generate", str(out), "--prompt", "The cache", "--max-new-tokens", "2", "--expert-cache", "1x")
    assert run.returncode == 0, run.stderr


def test_force_replaces_only_an_import_and_a_gguf_given_to_other_commands_names_the_import(imported, tmp_path):
    """(The CLI's `main` in this process: six commands without starting torch six times.)"""
    path = imported("qwen2-q8")[0]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for args, message in (
        (("--out", str(mine)), "exists and is not empty; choose another --out or pass --force"),
        (("--out", str(mine), "--force"), "weightstream did not write it"),
        (("--out", os.path.dirname(path), "--force"), "holds the source"),
    ):
        code, _, err = ran_in_process("import", path, *args)
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1 and err.startswith("weightstream import: error: ")
    assert os.listdir(mine) == ["notes.txt"]
    out = tmp_path / "out"
    assert ran_in_process("import", path, "--out", out)[0] == 0
    code, stdout, err = ran_in_process("import", path, "--out", out, "--force")
    assert code == 0 and "wrote" in stdout and read_manifest(str(out)).scheme == "q8_0", err
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    hint = f"a GGUF file; weightstream runs model directories. Import it once with `weightstream import {path} --out"
    code, _, err = ran_in_process("generate", path, "--prompt-ids", "1,2")  # serve too: both resolve_model
    assert code == 2 and hint in err, err
    with pytest.raises(WeightstreamError, match="Import it once with"):  # quantize, bench, tune, trace record
        open_checkpoint(path)


def big_gguf(path, layers: int, experts: int = 64, hidden: int = 1024, inter: int = 1024) -> int:
    """A qwen3moe GGUF of random Q8_0 experts and BF16 dense weights (no tokenizer); returns the experts' bytes."""
    arch, heads, vocab = "qwen3moe", 8, 512
    rng = np.random.default_rng(5)

    def blocks(*shape):  # random bytes: a direct type's values are never decoded by the import
        return Lazy(shape, lambda: rng.integers(0, 256, size=shape, dtype=np.uint8))

    meta = [
        (f"{arch}.block_count", layers),
        (f"{arch}.context_length", 512),
        (f"{arch}.embedding_length", hidden),
        (f"{arch}.attention.head_count", heads),
        (f"{arch}.attention.head_count_kv", heads),
        (f"{arch}.attention.key_length", hidden // heads),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        (f"{arch}.expert_count", experts),
        (f"{arch}.expert_used_count", 8),
        (f"{arch}.expert_feed_forward_length", inter),
    ]
    q8 = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]  # bytes per block of 32 weights
    tensors = [
        ("token_embd.weight", "BF16", blocks(vocab, hidden * 2)),
        ("output.weight", "BF16", blocks(vocab, hidden * 2)),
    ]
    tensors.append(("output_norm.weight", "F32", np.ones(hidden, np.float32)))
    for i in range(layers):
        for name, rows in (("attn_q", hidden), ("attn_k", hidden), ("attn_v", hidden), ("attn_output", hidden)):
            tensors.append((f"blk.{i}.{name}.weight", "BF16", blocks(rows, hidden * 2)))
        for name, size in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", 128), ("attn_k_norm", 128)):
            tensors.append((f"blk.{i}.{name}.weight", "F32", np.ones(size, np.float32)))
        tensors.append((f"blk.{i}.ffn_gate_inp.weight", "F32", np.zeros((experts, hidden), np.float32)))
        for proj, (rows, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors.append((f"blk.{i}.ffn_{proj}_exps.weight", "Q8_0", blocks(experts, rows, k // 32 * q8)))
    write_gguf(path, arch, meta, tensors)
    return layers * experts * 3 * hidden * inter // 32 * q8


def test_peak_rss_is_bounded_on_a_file_whose_experts_are_16x_the_bound(tmp_path):
    """One dense tensor or one expert at a time, read with pread (never the reader's memory map): peak RSS stays
    within the baseline (imports, the parsed header, the meta model) + the largest dense tensor + 32 MiB, for
    experts of 16x that bound. Measured 13 MiB at 408 MiB and at 1020 MiB of experts, with glibc mapping every
    buffer over 128 KiB on its own, as tests/test_quantize.py measures (its docstring says why)."""
    bound = 32 * 2**20
    path = str(tmp_path / "big.gguf")
    experts = big_gguf(path, layers=3)
    assert experts >= 16 * bound
    dense_max = 512 * 1024 * 2
    code = (
        "import json, sys; from weightstream.bench.child import peak_rss; "
        "from weightstream.store import gguf_import as g;"
        "gf = g.open_gguf(sys.argv[1]); arch, fields = g.gguf_config(gf); g._plan(gf, arch, fields, 'auto');"
        "g._tokenizer(gf); base = peak_rss(); g.import_gguf(sys.argv[1], sys.argv[2], log=lambda line: None);"
        "print(json.dumps([base, peak_rss()]))"
    )
    base, peak = peak_over_baseline(code, path, str(tmp_path / "out"))
    assert peak - base <= dense_max + bound, (peak - base) / 2**20
    assert read_manifest(str(tmp_path / "out")).scheme == "q8_0"
