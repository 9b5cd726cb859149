"""Checkpoints in the layouts FP8 and MXFP4 models are published in, written from a tiny bf16 checkpoint.

FP8 as DeepSeek-V3 and the Qwen3 FP8 releases store it: every projection weight (out, in) float8_e4m3fn with
`<name>_scale_inv` float32 (ceil(out / 128), ceil(in / 128)), the multiplier of its 128 x 128 block (the last
blocks partial); norms, embeddings, the router and the head as they were. MXFP4 as gpt-oss stores it: the experts'
`gate_up_proj_blocks` (E, 2I, H / 32, 16) uint8 (two E2M1 codes a byte, the low nibble the even element) with
`gate_up_proj_scales` (E, 2I, H / 32) uint8 (E8M0: 2^(s - 127)), the same for `down_proj`, biases in bf16. The
encoders here are written from those descriptions, not from weightstream's readers, so a reader that shuffles
nibbles or blocks the wrong way disagrees with them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_FP8_WEIGHT = re.compile(r"_proj(_with_mqa)?\.weight$")  # DeepSeek's linears; not the router, norms, embeddings


def _rewrite(src: str, dst: str, convert, quantization_config: dict | None) -> str:
    """Copy `src` to `dst`, each shard's tensors passed through `convert(name, tensor) -> {name: tensor}`, with
    `quantization_config` in config.json (None: none)."""
    shutil.copytree(src, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    index = json.load(open(index_path))
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(dst, shard)
        out = {}
        for name, tensor in load_file(path).items():
            out.update(convert(name, tensor))
        save_file(out, path, metadata={"format": "pt"})
        weight_map.update({name: shard for name in out})
    index["weight_map"] = dict(sorted(weight_map.items()))
    json.dump(index, open(index_path, "w"), indent=2)
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    json.dump(config, open(config_path, "w"), indent=2)
    return dst


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> (float8_e4m3fn (out, in), float32 scale_inv (ceil(out / block), ceil(in / block))): each
    block's largest magnitude maps to 448, e4m3's largest finite value."""
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).reshape(rows * block, cols * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """float32 weights: each e4m3 value times its block's scale_inv (DeepSeek's own reading of the format)."""
    n, k = q.shape
    s = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def fp8_checkpoint(src: str, dst: str, scales=lambda name, s: s) -> str:
    """`src` with every projection weight as FP8 with 128 x 128 block scales; `scales(name, scale)` may damage
    one (the bad-input tests)."""

    def convert(name, tensor):
        if not _FP8_WEIGHT.search(name):
            return {name: tensor}
        q, s = fp8_blocks(tensor)
        out = {name: q}
        s = scales(name, s)
        if s is not None:
            out[f"{name}_scale_inv"] = s
        return out

    return _rewrite(src, dst, convert, FP8_CONFIG)


def fp8_reference(fp8_dir: str, dst: str) -> str:
    """The bf16 checkpoint whose weights are `fp8_dir`'s dequantized (each product rounded to bf16 once, as
    transformers' own FP8 dequantization rounds it)."""
    tensors = {}
    for name in os.listdir(fp8_dir):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(fp8_dir, name)))

    def convert(name, tensor):
        if name.endswith("_scale_inv"):
            return {}
        if tensor.dtype == torch.float8_e4m3fn:
            return {name: fp8_dequantize(tensor, tensors[f"{name}_scale_inv"]).to(torch.bfloat16)}
        return {name: tensor}

    return _rewrite(fp8_dir, dst, convert, None)


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., rows, in) -> blocks (..., rows, in / 32, 16) uint8 and scales (..., rows, in / 32) uint8: per 32
    inputs a power-of-two scale putting the largest magnitude in [4, 8), each weight the nearest E2M1 value, two
    codes a byte with the even element in the low nibble."""
    *lead, rows, k = w.shape
    b = w.float().reshape(*lead, rows, k // 32, 32)
    amax = b.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.zeros_like(amax))
    scales = (exponent + 127).clamp(0, 254).to(torch.uint8)
    scaled = b / torch.exp2(scales.float() - 127).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8)  # (..., G, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, scales


def mxfp4_checkpoint(src: str, dst: str, scales=lambda name, s: s) -> str:
    """gpt_oss `src` with its experts' projections as MXFP4 blocks and scales (biases stay bf16)."""

    def convert(name, tensor):
        if not re.search(r"\.experts\.(gate_up|down)_proj$", name):
            return {name: tensor}
        blocks, s = mxfp4_encode(tensor.transpose(1, 2))  # stored (E, in, out) -> (E, out, in)
        out = {f"{name}_blocks": blocks}
        s = scales(name, s)
        if s is not None:
            out[f"{name}_scales"] = s
        return out

    return _rewrite(src, dst, convert, MXFP4_CONFIG)


def random_biases(src: str, dst: str) -> str:
    """`src` with every bias random (synth writes zeros, which would hide a bias read from the wrong place)."""
    gen = torch.Generator().manual_seed(11)

    def convert(name, tensor):
        if "bias" in name.rsplit(".", 1)[-1] and tensor.is_floating_point():
            return {name: (torch.randn(tensor.shape, generator=gen) * 0.05).to(tensor.dtype)}
        return {name: tensor}

    return _rewrite(src, dst, convert, None)


def random_published(dst: str, fields: dict, kind: str) -> str:
    """A published checkpoint written straight from a config's shapes, shard by shard, without a bf16 source:
    random FP8 values (no NaN) with block scales, or random MXFP4 blocks with scales 2^-9 .. 2^-4; the other
    tensors random bf16 (norms 1). Every expert of a shape holds the same values (the memory test needs the
    bytes, not their variety)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config.architectures = [type(model).__name__]
    config.quantization_config = FP8_CONFIG if kind == "fp8" else MXFP4_CONFIG
    os.makedirs(dst)
    config.save_pretrained(dst)
    gen = torch.Generator().manual_seed(5)
    made: dict = {}

    def values(key, make):
        if key not in made:
            made[key] = make()
        return made[key].clone()

    def fp8(shape):
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x7E  # 0x7F and 0xFF are e4m3fn's NaN
        return raw.view(torch.float8_e4m3fn)

    def tensors(name, meta):
        shape = tuple(meta.shape)
        if kind == "fp8" and _FP8_WEIGHT.search(name) and len(shape) == 2:
            scale = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            return {
                name: values(("fp8", shape), lambda: fp8(shape)),
                f"{name}_scale_inv": values(("s", scale), lambda: torch.rand(scale, generator=gen) * 1e-3 + 1e-3),
            }
        if kind == "mxfp4" and re.search(r"\.experts\.(gate_up|down)_proj$", name):
            e, k, n = shape  # stored (E, in, out)
            blocks = values(("b", shape), lambda: torch.randint(0, 256, (e, n, k // 32, 16), generator=gen))
            scales = values(("s", shape), lambda: torch.randint(118, 124, (e, n, k // 32), generator=gen))
            return {f"{name}_blocks": blocks.to(torch.uint8), f"{name}_scales": scales.to(torch.uint8)}
        if "norm" in name:
            return {name: torch.ones(shape, dtype=meta.dtype)}
        return {
            name: values(("w", shape, meta.dtype), lambda: torch.randn(shape, generator=gen).mul(0.02)).to(meta.dtype)
        }

    by_layer: dict[int, dict] = {}
    for name, meta in model.state_dict().items():
        match = re.search(r"\.layers\.(\d+)\.", name)
        by_layer.setdefault(int(match.group(1)) if match else -1, {})[name] = meta
    weight_map = {}
    for i, layer in enumerate(sorted(by_layer)):
        shard = f"model-{i + 1:05d}-of-{len(by_layer):05d}.safetensors"
        out = {}
        for name, meta in revert_weight_conversion(model, by_layer[layer]).items():
            out.update(tensors(name, meta))
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in out})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f)
    return dst
