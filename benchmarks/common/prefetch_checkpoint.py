"""Build a synthetic Qwen3-MoE checkpoint of a given size, written the way save_pretrained writes one.

transformers describes the model (config, parameter names and shapes, on the meta device: no memory); the
fused expert parameters are written per expert (experts.{e}.gate_proj/up_proj/down_proj), as save_pretrained
does, so from_pretrained runs its real conversion on load. Values are random finite bf16. Nothing is
downloaded. Shards of at most 2 GiB with a model.safetensors.index.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

SHARD = 2 << 30
MIB = 1 << 20
EXPERTS, HIDDEN, MOE_INTER, VOCAB = 64, 1024, 512, 32000


def config_for(total_bytes: int):
    """A qwen3_moe config whose bf16 weights are at least total_bytes."""
    from transformers import Qwen3MoeConfig

    per_layer = EXPERTS * 3 * HIDDEN * MOE_INTER * 2 + 5 * MIB  # experts + attention, bf16
    fixed = 2 * VOCAB * HIDDEN * 2
    layers = max(1, math.ceil((total_bytes - fixed) / per_layer))
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2048,
        moe_intermediate_size=MOE_INTER,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=EXPERTS,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def saved_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes as save_pretrained writes them (experts split per expert)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate [I, H], up [I, H] per expert
            base, (e, two_i, h) = name[: -len("gate_up_proj")], p.shape
            for k in range(e):
                out[f"{base}{k}.gate_proj.weight"] = (two_i // 2, h)
                out[f"{base}{k}.up_proj.weight"] = (two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I] -> [H, I] per expert
            base, (e, h, i) = name[: -len("down_proj")], p.shape
            for k in range(e):
                out[f"{base}{k}.down_proj.weight"] = (h, i)
        else:
            out[name] = tuple(p.shape)
    return out


def _random_bf16(shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    bits = rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)
    exponent = ((bits >> 7) & 0x7) + 119  # |x| in [2^-8, 2^0): finite, like trained weights
    bits = (bits & 0x807F) | (exponent << 7).astype(np.uint16)
    return torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)


def build(out: Path, total_bytes: int, seed: int = 0) -> Path:
    """Write the checkpoint to out (skipped when a complete one of this size is already there)."""
    marker = out / "complete.json"
    if marker.exists() and json.loads(marker.read_text()).get("target") == total_bytes:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = config_for(total_bytes)
    config.save_pretrained(out)
    shapes, rng = saved_shapes(config), np.random.default_rng(seed)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = _random_bf16(shape, rng)
        size += current[name].nbytes
        if size >= SHARD:
            shards.append(_write(out, len(shards), current))
            current, size = {}, 0
    if current:
        shards.append(_write(out, len(shards), current))
    _index(out, shards)
    marker.write_text(json.dumps({"target": total_bytes, "bytes": sum(s[1] for s in shards)}))
    return out


def _write(out: Path, i: int, tensors: dict[str, torch.Tensor]) -> tuple[str, int, list[str]]:
    from safetensors.torch import save_file

    name = f"model-{i + 1:05d}.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    return name, sum(t.nbytes for t in tensors.values()), list(tensors)


def _index(out: Path, shards: list[tuple[str, int, list[str]]]) -> None:
    n = len(shards)
    weight_map = {}
    for i, (name, _, keys) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update({k: final for k in keys})
    doc = {"metadata": {"total_size": sum(s[1] for s in shards)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), int(float(sys.argv[2]) * (1 << 30))))
