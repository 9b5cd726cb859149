"""Token-exactness: the streaming engine's greedy tokens equal transformers' eager in-memory model's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.store.presets import TINY

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
NEW_TOKENS = 12
SIZES = ("1x", "1.5x", "4x", "100x")  # 100x: every expert resident
THREADS = (1, 2, 8)


def reference_tokens(model_dir):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.inference_mode():
        out = ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, PROMPT.shape[1]:].tolist()


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tokens_equal_eager_in_memory(tiny_model, arch):
    model_dir = tiny_model(arch)
    expected = reference_tokens(model_dir)
    assert len(expected) == NEW_TOKENS
    for size in SIZES:
        for threads in THREADS:
            model = load_streaming_model(model_dir, expert_cache=size, io_threads=threads)
            try:
                new, stats = generate(model, PROMPT, NEW_TOKENS)
            finally:
                model.weightstream.close()
            assert new[0].tolist() == expected, (arch, size, threads)
            assert stats.expert_misses > 0 and stats.bytes_read > 0
            if size == "100x":  # all resident: each expert is read at most once
                assert stats.expert_misses <= len(model.weightstream.layout.experts)


def test_tokens_equal_in_bf16(tiny_model):
    model_dir = tiny_model("qwen3_moe", "bf16")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, experts_implementation="eager")
    with torch.inference_mode():
        expected = ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    model = load_streaming_model(model_dir, expert_cache="1x", io_threads=2)
    new, _ = generate(model, PROMPT, NEW_TOKENS)
    model.weightstream.close()
    assert new[0].tolist() == expected


def test_small_cache_misses_more_than_large(tiny_model):
    model_dir = tiny_model("mixtral")
    misses = {}
    for size in ("1x", "100x"):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=2)
        _, stats = generate(model, PROMPT, NEW_TOKENS)
        model.weightstream.close()
        misses[size] = stats.expert_misses
    assert misses["1x"] > misses["100x"]


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "gpt_oss"])  # gate/up apart, adjacent, fused on disk
def test_page_cache_source_is_exact_too(tiny_model, arch):
    model_dir = tiny_model(arch)
    model = load_streaming_model(model_dir, expert_source="page-cache")
    new, stats = generate(model, PROMPT, NEW_TOKENS)
    model.weightstream.close()
    assert new[0].tolist() == reference_tokens(model_dir)
    assert stats.bytes_read == 0 and stats.expert_cache_bytes == 0
