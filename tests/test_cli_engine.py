"""The generate and synth commands as a user runs them: real subprocesses, JSON on stdout, clear errors."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_support import refused_in_process


def ws(*args):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_synth_then_generate_json(tmp_path):
    out = tmp_path / "m"
    r = ws("synth", "--preset", "tiny", "--arch", "olmoe", "--dtype", "fp32", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model_type"] == "olmoe"
    r = ws(
        "generate",
        str(out),
        "--prompt-ids",
        "4,8,15,16,23,42",
        "--max-new-tokens",
        "6",
        "--json",
        "--expert-cache",
        "1x",
        "--io-threads",
        "2",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, experts_implementation="eager")
    expected = ref.generate(torch.tensor([[4, 8, 15, 16, 23, 42]]), max_new_tokens=6, do_sample=False)[0, 6:].tolist()
    assert result["token_ids"] == expected
    for key in (
        "prefill_s",
        "decode_tokens_per_s",
        "expert_hit_rate",
        "bytes_read",
        "bytes_read_per_token",
        "io_wait_s",
        "expert_cache_bytes",
        "working_set_bytes",
    ):
        assert key in result["stats"], key
    assert result["text"] == AutoTokenizer.from_pretrained(str(out)).decode(expected, skip_special_tokens=True)
    assert result["text"]  # the tiny tokenizer's text of these tokens is not empty: an empty one is a defect
    r = ws("generate", str(out), "--prompt", "Hello there", "--max-new-tokens", "3")
    assert r.returncode == 0 and "tok/s" in r.stderr


def test_errors_are_one_clear_line(tmp_path):
    """Each a one-line error and exit 2: the first in a real process, the rest by the CLI's `main` in this one (the
    same code, without starting an interpreter and torch six more times)."""
    out = tmp_path / "m"
    assert refused_in_process("synth", "--preset", "tiny", "--dtype", "fp32", "--out", out)[0] == 0
    r = ws("generate", str(out), "--prompt-ids", "1,2", "--expert-cache", "0.5x")
    assert r.returncode == 2 and "below one token's working set" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    cases = [
        (("generate", out, "--prompt-ids", "1,x"), "comma-separated integers"),
        (("generate", out, "--prompt-ids", "1", "--expert-cache", "lots"), "not a size"),
        (("generate", out, "--prompt-ids", "99999"), "outside the vocabulary"),
        (("generate", tmp_path / "nope", "--prompt-ids", "1"), "not a model directory"),
        (("synth", "--preset", "tiny", "--out", out), "not empty"),
    ]
    for args, message in cases:
        code, err = refused_in_process(*args)
        assert code == 2 and message in err, (args, err)


def test_generate_from_a_filesystem_that_refuses_o_direct(tiny_model, tmp_path):
    """ramfs refuses O_DIRECT at open: generate says so once, reads buffered, and the tokens are unchanged."""
    import os
    import shutil

    import pytest

    where = tmp_path / "ramfs"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)]).returncode != 0:
        pytest.skip("needs root to mount a ramfs (CI is root); tests/test_reader.py injects the refusal instead")
    try:
        model_dir = shutil.copytree(tiny_model("olmoe"), where / "m")
        args = ("--prompt-ids", "4,8,15,16", "--max-new-tokens", "5", "--expert-cache", "1x", "--json")
        r = ws("generate", str(model_dir), *args)
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("O_DIRECT refused for") == 1 and "falling back to buffered reads" in r.stderr
        result = json.loads(r.stdout)
        assert result["stats"]["o_direct"] is False
        direct = json.loads(ws("generate", tiny_model("olmoe"), *args).stdout)
        assert direct["stats"]["o_direct"] is True and direct["token_ids"] == result["token_ids"]
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_generate_keeps_a_deepseek_latent_cache_in_float16(tiny_model):
    """`generate --kv-dtype float16 --json` as a user runs it: the stats name the cache's dtype and its bytes a token,
    half the float32 cache's; a model without latent attention refuses it in one line."""
    model_dir = tiny_model("deepseek_v3")
    stats = {}
    for kv in ("auto", "float16"):
        r = ws("generate", model_dir, "--prompt-ids", "4,8,15,16", "--max-new-tokens", "3", "--json", "--kv-dtype", kv)
        assert r.returncode == 0, r.stderr
        stats[kv] = json.loads(r.stdout)["stats"]
    assert (stats["auto"]["kv_dtype"], stats["float16"]["kv_dtype"]) == ("float32", "float16")
    assert stats["auto"]["kv_cache_bytes_per_token"] == 2 * stats["float16"]["kv_cache_bytes_per_token"] > 0
    r = ws("generate", tiny_model("qwen3_moe"), "--prompt-ids", "4,8", "--max-new-tokens", "2", "--kv-dtype", "float16")
    assert r.returncode == 2 and "has no latent attention" in r.stderr and len(r.stderr.strip().splitlines()) == 1
