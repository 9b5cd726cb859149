"""The model a command names: a local directory, or a Hugging Face id to download. Light on imports, so that a
command refuses a wrong name before it loads torch and transformers (seconds)."""

from __future__ import annotations

import os
import re
import shlex

from weightstream.errors import WeightstreamError


def resolve_model(name: str) -> str:
    """A local directory as is; otherwise a Hugging Face model id, downloaded (config, tokenizer, safetensors)."""
    if os.path.isdir(name):
        return name
    if name.lower().endswith(".gguf"):
        raise WeightstreamError(gguf_hint(name))
    if os.path.exists(name) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        raise WeightstreamError(
            f"{name}: not a model directory; pass a directory with config.json and "
            "*.safetensors (make one with `weightstream synth`) or a Hugging Face id org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja"])
    except Exception as exc:  # offline, unknown id, gated model: one clear line
        raise WeightstreamError(
            f"{name}: could not download from the Hugging Face Hub ({type(exc).__name__}: "
            f"{exc}); pass a local model directory instead"
        ) from exc


def gguf_hint(path: str) -> str:
    """What a command given a .gguf file says: the one command that makes it a model directory."""
    out = re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", os.path.basename(path), flags=re.IGNORECASE) or "model"
    missing = "" if os.path.exists(path) else " (and there is no such file)"
    return (
        f"{path}: a GGUF file{missing}; weightstream runs model directories. Import it once with "
        f"`weightstream import {shlex.quote(path)} --out {shlex.quote(out)}` and pass that directory"
    )
