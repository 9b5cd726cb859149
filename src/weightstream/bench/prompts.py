"""Prompts as users give them (a text file, one per line, or .jsonl with a 'prompt' field) and built-in ones."""

from __future__ import annotations

import json
from pathlib import Path

from weightstream.errors import WeightstreamError

BUILTIN_PROMPTS = (
    "Explain why a cache that is smaller than the working set of one token cannot help.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The capital of France is Paris. The capital of Germany is",
    "Write a short story about a small computer that runs a very large model from its disk.",
)


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one per line) or a .jsonl file with a 'prompt' field per line."""
    p = Path(path)
    if not p.is_file():
        raise WeightstreamError(f"{path}: no such prompts file")
    prompts = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise WeightstreamError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field") from None
        else:
            prompts.append(line)
    if not prompts:
        raise WeightstreamError(f"{path}: no prompts (the file is empty)")
    return prompts


def tokenized_prompts(model_dir: str, path: str | None) -> list[list[int]]:
    """Token ids of the prompts in `path`, or of the built-in prompts, by the checkpoint's tokenizer."""
    from weightstream.engine.loader import load_tokenizer

    texts = read_prompts(path) if path else BUILTIN_PROMPTS
    tokenizer = load_tokenizer(model_dir, required=True)
    return [tokenizer(t).input_ids for t in texts]


def long_prompt(model_dir: str, n: int) -> list[int]:
    """`n` token ids of text: the built-in prompts, repeated as often as needed."""
    from weightstream.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir, required=True)
    ids: list[int] = []
    while len(ids) < n:
        before = len(ids)
        ids += tokenizer(" ".join(BUILTIN_PROMPTS)).input_ids
        if len(ids) == before:
            raise WeightstreamError(f"{model_dir}: the tokenizer gives no tokens for the built-in prompts")
    return ids[:n]
