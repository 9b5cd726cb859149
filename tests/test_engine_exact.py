"""Exactness: the streaming engine's logits are bitwise those of transformers' eager in-memory model."""

import pytest
import torch

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.store.presets import TINY

from engine_support import DTYPES, EXPANDED, NEW_TOKENS, PROMPT, greedy_logits, reference

SIZES = ("1x", "1.5x", "4x", "100x")  # 100x: every expert resident
THREADS = (1, 2, 8)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(TINY))
def test_logits_bitwise_equal_eager_in_memory(tiny_model, arch, dtype):
    """At every decode step the final logits are torch.equal to eager's, whatever the cache size and I/O threads."""
    model_dir = tiny_model(arch, dtype)
    expected_tokens, expected_logits = reference(model_dir, dtype)
    assert len(expected_tokens) == NEW_TOKENS
    for size in SIZES:
        for threads in THREADS:
            model = load_streaming_model(model_dir, expert_cache=size, io_threads=threads, **EXPANDED)
            try:
                tokens, logits = greedy_logits(model)
                stats = model.weightstream.cache.stats
            finally:
                model.weightstream.close()
            assert tokens == expected_tokens, (arch, dtype, size, threads)
            assert len(logits) == len(expected_logits)
            for step, (got, want) in enumerate(zip(logits, expected_logits)):
                assert got.dtype == want.dtype and torch.equal(got, want), (arch, dtype, size, threads, step)
            assert stats.misses > 0
            if size == "100x":  # all resident: each expert is read at most once
                assert stats.misses <= len(model.weightstream.layout.experts)


def test_generate_stats_count_reads(tiny_model):
    model = load_streaming_model(tiny_model("qwen3_moe"), expert_cache="1x", io_threads=2)
    new, stats = generate(model, PROMPT, NEW_TOKENS)
    model.weightstream.close()
    assert new.shape == (1, NEW_TOKENS) and stats.generated_tokens == NEW_TOKENS
    assert stats.expert_misses > 0 and stats.bytes_read > 0 and stats.decode_tokens_per_s > 0


def test_small_cache_misses_more_than_large(tiny_model):
    model_dir = tiny_model("mixtral")
    misses = {}
    for size in ("1x", "100x"):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=2)
        _, stats = generate(model, PROMPT, NEW_TOKENS)
        model.weightstream.close()
        misses[size] = stats.expert_misses
    assert misses["1x"] > misses["100x"]


@pytest.mark.usefixtures("no_proactive_reclaim")  # asserts no byte is read back from disk
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(TINY))
def test_page_cache_source_is_bitwise_exact_too(tiny_model, arch, dtype):
    model_dir = tiny_model(arch, dtype)
    expected_tokens, expected_logits = reference(model_dir, dtype)
    # bytes_read is the kernel's count for the whole process, its own code included: a first run brings back what
    # reclaim took since the session began (the model's pages, torch's code); with reclaim paused the second reads
    # nothing from disk
    for _ in range(2):
        model = load_streaming_model(model_dir, expert_source="page-cache", **EXPANDED)
        tokens, logits = greedy_logits(model)
        stats = model.weightstream.cache
        model.weightstream.close()
    assert tokens == expected_tokens
    assert all(torch.equal(got, want) for got, want in zip(logits, expected_logits, strict=True))
    assert stats.bytes_read == 0 and stats.memory_bytes == 0


def _misaligned_copy(src: str, dst: str) -> str:
    """`src` re-saved so that every tensor starts 8 bytes past a 16-byte boundary (as many Hub files do)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            path = os.path.join(dst, name)
            tensors = load_file(path)
            for pad in range(64):  # the header's length decides where the data starts
                save_file(tensors, path, metadata={"pad": "x" * pad})
                with open(path, "rb") as f:
                    if (8 + int.from_bytes(f.read(8), "little")) % 64 == 8:
                        break
    return dst


@pytest.mark.parametrize("arch", ["deepseek_v3", "olmoe", "gpt_oss"])  # merged on load, merged, fused on disk
def test_misaligned_files_are_still_bitwise_exact(tiny_model, tmp_path, arch):
    """fp32 gemv rounds differently 8 bytes off 16: experts sit where eager's copy would (packed if need be)."""
    from weightstream.store.checkpoint import open_checkpoint

    model_dir = _misaligned_copy(tiny_model(arch), str(tmp_path / "m"))
    assert {t.offset % 16 for t in open_checkpoint(model_dir).tensors.values()} == {8}
    expected_tokens, expected_logits = reference(model_dir)
    for source, size in (("expert-cache", "1x"), ("expert-cache", "100x"), ("page-cache", "1x")):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=2, expert_source=source, **EXPANDED)
        try:
            tokens, logits = greedy_logits(model)
        finally:
            model.weightstream.close()
        assert tokens == expected_tokens, (source, size)
        assert all(torch.equal(g, w) for g, w in zip(logits, expected_logits, strict=True)), (source, size)
