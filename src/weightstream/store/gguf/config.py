"""config.json from a GGUF file's metadata: the fields every architecture shares here, the rest by its family
(families/). Our own mapping: transformers' lacks fields these architectures need (docs/gguf.md)."""

from __future__ import annotations

import re

from weightstream.errors import WeightstreamError
from weightstream.store.gguf.families import FAMILIES, SUPPORTED, Family, decimal
from weightstream.store.gguf.reader import MISSING, GgufFile


def family_of(gf: GgufFile) -> tuple[str, Family]:
    """(GGUF architecture, its family), or an error naming the architecture and the supported ones."""
    arch = gf.value("general.architecture", why="the model's architecture", kind=str)
    family = FAMILIES.get(arch)
    why = f"architecture {arch!r}" if family is None else family.refuse(gf, _key(gf, arch))
    if why:
        raise WeightstreamError(
            f"{gf.path}: {why}; weightstream streams Mixture-of-Experts models and imports these GGUF "
            f"architectures: {SUPPORTED}"
        )
    return arch, family


def gguf_config(gf: GgufFile) -> tuple[str, dict]:
    """(GGUF architecture, transformers config fields) from the file's metadata, checked against its tensors."""
    arch, family = family_of(gf)
    key = _key(gf, arch)
    rope = family.rope_parameters(gf, key)
    heads = key("attention.head_count", why="attention heads", kind=(int, list))
    kv_heads = key("attention.head_count_kv", heads, kind=(int, list))
    for name, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if isinstance(value, list):
            raise WeightstreamError(
                f"{gf.path}: {arch}.{name} differs per layer ({value[:4]}...); not supported by {family.model_type}"
            )
        if value < 1:
            raise WeightstreamError(
                f"{gf.path}: {arch}.{name} is 0; a model has 1 or more heads: the file is damaged, convert the model "
                "again"
            )
    hidden = key("embedding_length", why="hidden size")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2 or embed.shape[1] != hidden:
        got = "missing" if embed is None else f"shaped {list(embed.shape)}"
        raise WeightstreamError(
            f"{gf.path}: tensor 'token_embd.weight' is {got}, expected (vocabulary, {hidden}); the file is damaged"
        )
    # llama.cpp counts the next-token-prediction layers it appends in block_count (GLM-4.5's, some DeepSeek files')
    blocks, nextn = key("block_count", why="layers"), key("nextn_predict_layers", 0)
    held = max((int(m.group(1)) + 1 for name in gf.tensors if (m := re.match(r"blk\.(\d+)\.", name))), default=0)
    if blocks > held or nextn > blocks:  # before a model of that many layers is built
        raise WeightstreamError(
            f"{gf.path}: {arch}.block_count is {blocks} ({arch}.nextn_predict_layers {nextn}), the file's tensors "
            f"hold {held} layer(s); the metadata and the tensors disagree or the file is damaged: convert the model "
            "again"
        )
    fields = {
        "model_type": family.model_type,
        "num_hidden_layers": blocks - nextn,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": key("context_length", why="context length"),
        "rms_norm_eps": decimal(key("attention.layer_norm_rms_epsilon", why="RMS norm epsilon", kind=float)),
        "rope_theta": decimal(key("rope.freq_base", 10000.0)),  # llama.cpp's default when a file has none
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        family.experts_field: key("expert_count", why="routed experts per layer"),
        "num_experts_per_tok": key("expert_used_count", why="experts per token"),
    }
    if rope is not None:
        del fields["rope_theta"]
        fields["rope_parameters"] = rope
    width = key("expert_feed_forward_length", None)
    fields[family.width_field] = width if width is not None else key("feed_forward_length", why="expert width")
    if family.norm_topk is not None:
        fields["norm_topk_prob"] = bool(key("expert_weights_norm", family.norm_topk))
    family.config(gf, key, fields)
    for name, config_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = gf.value(f"tokenizer.ggml.{name}_token_id", None)  # absent: none (not the config class's default)
        if value is not None and value >= embed.shape[0]:
            raise WeightstreamError(
                f"{gf.path}: tokenizer.ggml.{name}_token_id is {value}, past the vocabulary of {embed.shape[0]} "
                "tokens (the rows of token_embd.weight); the file is damaged: convert the model again"
            )
        fields[config_key] = None if value is None else int(value)
    return arch, fields


def _key(gf: GgufFile, arch: str):
    def key(name: str, default=MISSING, why: str = "", kind=None):
        return gf.value(f"{arch}.{name}", default, why, kind)

    return key
