"""The model a checkpoint describes: its config, dtype and top-k, as a transformers model on the meta device
(no memory) with every expert's byte ranges mapped (`layout.build_layout`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import Checkpoint, open_checkpoint
from weightstream.store.dtypes import FLOATS, torch_dtype, weights_dtype
from weightstream.store.facts import TOP_K_FIELDS, top_k
from weightstream.store.layout import ModelLayout, build_layout, streamable_modules
from weightstream.store.published import Published, fresh_copy, read_published
from weightstream.store.quant.manifest import QuantFormat, read_manifest


@dataclass(slots=True)
class MappedModel:
    """A checkpoint directory opened: its index, config, quantization (None: experts as transformers stores
    them), the meta-device model and where every expert's bytes are; for a published FP8 / MXFP4 checkpoint mapped
    as it is (`convert=False`), `published` reads its tensors and `ckpt` is its logical view (store/published.py)."""

    ckpt: Checkpoint
    config: object
    quant: QuantFormat | None
    model: torch.nn.Module
    layout: ModelLayout
    published: Published | None = None


def map_model(model_dir: str, experts_implementation: str = "eager", convert: bool = True) -> MappedModel:
    """Index `model_dir` and build its model on the meta device, experts mapped to byte ranges; reads only. A
    published FP8 / MXFP4 checkpoint maps to the converted copy it runs through, where one was made from its files as
    they are (store/convert.py makes it; the engine's loader does so), or with `convert=False` to its own logical
    view (what `quantize` reads)."""
    ckpt = open_checkpoint(model_dir)
    published = read_published(ckpt)
    if published is not None and convert:
        copy = fresh_copy(published)
        if copy is None:
            raise WeightstreamError(
                f"{model_dir} is {published.describe()}: it runs through a converted copy under "
                f"{model_dir}/.weightstream, not made yet (or made from other files). `weightstream generate "
                f"{model_dir}` (or serve, bench, tune) makes it once; in Python, "
                "weightstream.store.convert.runnable_dir(model_dir) does and returns its path"
            )
        return map_model(copy, experts_implementation)
    if published is not None:
        ckpt = published.checkpoint
    config = load_config(model_dir)
    quant = read_manifest(model_dir)
    if published is not None:
        dtype = published.dtype
    else:
        dtype = quant.compute_dtype if quant is not None else checkpoint_dtype(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=experts_implementation)
    streamable_modules(model, model_dir)
    layout = build_layout(model, ckpt, top_k_of(config, model_dir), quant)
    return MappedModel(ckpt, config, quant, model, layout, published)


def checkpoint_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The dtype most of the checkpoint's bytes are in (`dtypes.weights_dtype`); the model is built in it so bytes
    are used as they are."""
    dtype = weights_dtype(ckpt.tensors.values())
    if dtype not in FLOATS:
        raise WeightstreamError(
            f"{ckpt.model_dir}: weights are mostly {dtype} and there is no weightstream quantization manifest; "
            f"weightstream streams {', '.join(FLOATS)} checkpoints and its own int8/int4 format "
            "(`weightstream quantize`)"
        )
    return torch_dtype(dtype)


def top_k_of(config, model_dir: str) -> int:
    value = top_k(config)
    if value is not None:
        return value
    raise WeightstreamError(
        f"{model_dir}/config.json: no experts-per-token field ({', '.join(TOP_K_FIELDS)}); "
        "is this a Mixture-of-Experts model?"
    )


def load_config(model_dir: str):
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise WeightstreamError(f"{model_dir}/config.json: transformers cannot read it ({exc})") from exc
