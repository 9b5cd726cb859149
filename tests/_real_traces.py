"""The project's real routing traces, imported once per test process (set WEIGHTSTREAM_TRACES to move them)."""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import pytest

from weightstream.trace import resolve_shape
from weightstream.trace.importers import import_moe_beyond_csv, import_vllm_jsonl

TRACES = Path(os.environ.get("WEIGHTSTREAM_TRACES", "/work/shared/traces"))
MIXTRAL_FILES = [TRACES / "mixtral-8x7b-instruct" / n for n in ("humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl")]


def deepseek_files() -> list[Path]:
    """Prompt CSVs in prompt-number order (prompt 317 is absent upstream)."""
    files = (TRACES / "deepseek-v2-lite-chat").glob("prompt_*_data.csv")
    return sorted(files, key=lambda p: int(re.search(r"prompt_(\d+)_", p.name).group(1)))


def need_traces() -> None:
    """Skip (with the reason) where the real traces are not on this machine."""
    if not all(p.is_file() for p in MIXTRAL_FILES) or not deepseek_files():
        pytest.skip(f"real traces not found under {TRACES} (set WEIGHTSTREAM_TRACES)")


@cache
def mixtral():
    """Mixtral-8x7B decode routing: HumanEval then GSM8K, 2 problems each."""
    need_traces()
    return import_vllm_jsonl(MIXTRAL_FILES, resolve_shape("mixtral-8x7b"))


@cache
def deepseek(n_files: int | None = None):
    """DeepSeek-V2-Lite prompt routing, all 399 prompts or the first `n_files`."""
    need_traces()
    return import_moe_beyond_csv(deepseek_files()[:n_files], resolve_shape("deepseek-v2-lite"))
