"""The model a command names: a local directory, or a Hugging Face id to download. Light on imports, so that a
command refuses a wrong name before it loads torch and transformers (seconds)."""

from __future__ import annotations

import os
import re

from weightstream.errors import WeightstreamError


def resolve_model(name: str) -> str:
    """A local directory as is; otherwise a Hugging Face model id, downloaded (config, tokenizer, safetensors)."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        raise WeightstreamError(
            f"{name}: not a model directory; pass a directory with config.json and "
            "*.safetensors (make one with `weightstream synth`) or a Hugging Face id org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as exc:  # offline, unknown id, gated model: one clear line
        raise WeightstreamError(
            f"{name}: could not download from the Hugging Face Hub ({type(exc).__name__}: "
            f"{exc}); pass a local model directory instead"
        ) from exc
