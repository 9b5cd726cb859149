"""One module per GGUF architecture (`general.architecture`), each holding that family's config map and tensor-name
quirks (families/base.py has what they share); FAMILIES maps the GGUF name to it."""

from __future__ import annotations

from weightstream.store.gguf.families import deepseek2, glm4moe, gpt_oss, llama, olmoe, qwen2moe, qwen3moe
from weightstream.store.gguf.families.base import DenseSource, Family, Skipped, decimal

FAMILIES: dict[str, Family] = {
    m.FAMILY.arch: m.FAMILY for m in (qwen3moe, qwen2moe, olmoe, llama, deepseek2, glm4moe, gpt_oss)
}
SUPPORTED = ", ".join(f.label or f.arch for f in FAMILIES.values())

__all__ = ["FAMILIES", "SUPPORTED", "DenseSource", "Family", "Skipped", "decimal"]
