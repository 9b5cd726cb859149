"""Write a transformers-loadable checkpoint with random weights, layer by layer, in the architecture's on-disk form."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from weightstream.errors import WeightstreamError
from weightstream.store.layout import layer_index
from weightstream.store.outdir import built_in_place, refuse_existing
from weightstream.store.safetensors_writer import save_aligned
from weightstream.store.tokenizer import build_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(slots=True)
class SynthResult:
    out_dir: str
    model_type: str
    total_bytes: int
    shards: int


def synthesize(
    out_dir: str,
    fields: dict,
    dtype: str = "bf16",
    seed: int = 0,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    note: dict | None = None,
) -> SynthResult:
    """Write config, tokenizer (with a minimal chat template: store/tokenizer.py) and random weights to `out_dir`
    (built in a temp dir, renamed into place at the end); `note` is kept in the directory's ownership record
    (`outdir.read_owner`)."""
    if dtype not in DTYPES:
        raise WeightstreamError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    refuse_existing(out_dir, force)
    fields = dict(fields)
    tokenizer = build_tokenizer(fields["vocab_size"])
    config = AutoConfig.for_model(
        fields.pop("model_type"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    config.architectures = [type(model).__name__]  # as every Hub checkpoint has; converters such as llama.cpp's need it
    needed = sum(p.numel() * p.element_size() for p in model.state_dict(keep_vars=True).values())
    with built_in_place(out_dir, "synth", note, needed) as tmp:
        total, shards = _write_weights(model, tmp, seed, progress)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return SynthResult(out_dir, config.model_type, total, shards)


def _groups(model) -> list[list[str]]:
    """Tensor names (parameters and persistent buffers) grouped one shard per decoder layer, plus the rest."""
    by_layer: dict[int, list[str]] = {}
    rest = []
    for name in model.state_dict(keep_vars=True):
        layer = layer_index(name, -1)
        (by_layer.setdefault(layer, []) if layer >= 0 else rest).append(name)
    return [rest] + [by_layer[k] for k in sorted(by_layer)]


def _write_weights(model, out: str, seed: int, progress) -> tuple[int, int]:
    params = model.state_dict(keep_vars=True)
    groups = _groups(model)
    total = sum(p.numel() * p.element_size() for p in params.values())
    std = getattr(model.config, "initializer_range", None) or 0.02
    gen = torch.Generator().manual_seed(seed)
    weight_map, done = {}, 0
    for i, group in enumerate(groups):
        state = {name: _random_like(name, params[name], gen, std) for name in group}
        state = revert_weight_conversion(model, state)
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_aligned(state, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in state})
        done += sum(v.numel() * v.element_size() for v in state.values())
        if progress:
            progress(done, total)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": done}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return done, len(groups)


def _random_like(name: str, param: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return torch.ones(param.shape, dtype=param.dtype)
    if "bias" in leaf:
        return torch.zeros(param.shape, dtype=param.dtype)
    return torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(std).to(param.dtype)
