"""The project's real routing traces, imported once per test process.

They live in `../shared/traces` beside the repository (CI clones it with `../shared` next to it); set
WEIGHTSTREAM_TRACES to read them elsewhere. Where they are missing, the tests that need them skip and say why.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import pytest

from weightstream.trace import resolve_shape
from weightstream.trace.importers import import_moe_beyond_csv, import_vllm_jsonl

REPO = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("WEIGHTSTREAM_TRACES") or REPO.parent / "shared" / "traces")
MIXTRAL_FILES = [TRACES / "mixtral-8x7b-instruct" / n for n in ("humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl")]


def deepseek_files() -> list[Path]:
    """Prompt CSVs in prompt-number order (prompt 317 is absent upstream); skips the test when they are missing."""
    need_traces()
    files = (TRACES / "deepseek-v2-lite-chat").glob("prompt_*_data.csv")
    return sorted(files, key=lambda p: int(re.search(r"prompt_(\d+)_", p.name).group(1)))


def need_traces() -> None:
    """Skip (with the reason) where the real traces are not on this machine."""
    if not all(p.is_file() for p in MIXTRAL_FILES) or not any((TRACES / "deepseek-v2-lite-chat").glob("prompt_*.csv")):
        pytest.skip(
            f"real traces not found under {TRACES} (they belong in ../shared/traces beside the repository; "
            "set WEIGHTSTREAM_TRACES to read them elsewhere)"
        )


@cache
def mixtral(files: tuple[str, ...] = ("humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl")):
    """Mixtral-8x7B decode routing: HumanEval then GSM8K, 2 problems each (or the named files only)."""
    need_traces()
    return import_vllm_jsonl([TRACES / "mixtral-8x7b-instruct" / f for f in files], resolve_shape("mixtral-8x7b"))


@cache
def deepseek(n_files: int | None = None):
    """DeepSeek-V2-Lite prompt routing, all 399 prompts or the first `n_files`."""
    need_traces()
    return import_moe_beyond_csv(deepseek_files()[:n_files], resolve_shape("deepseek-v2-lite"))
