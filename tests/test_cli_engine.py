"""The generate and synth commands as a user runs them: real subprocesses, JSON on stdout, clear errors."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM


def ws(*args):
    return subprocess.run([sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=300)


def test_synth_then_generate_json(tmp_path):
    out = tmp_path / "m"
    r = ws("synth", "--preset", "tiny", "--arch", "olmoe", "--dtype", "fp32", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model_type"] == "olmoe"
    r = ws("generate", str(out), "--prompt-ids", "4,8,15,16,23,42", "--max-new-tokens", "6", "--json",
           "--expert-cache", "1x", "--io-threads", "2")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, experts_implementation="eager")
    expected = ref.generate(torch.tensor([[4, 8, 15, 16, 23, 42]]), max_new_tokens=6, do_sample=False)[0, 6:].tolist()
    assert result["token_ids"] == expected
    for key in ("prefill_s", "decode_tokens_per_s", "expert_hit_rate", "bytes_read", "bytes_read_per_token",
                "io_wait_s", "expert_cache_bytes", "working_set_bytes"):
        assert key in result["stats"], key
    assert isinstance(result["text"], str)
    r = ws("generate", str(out), "--prompt", "Hello there", "--max-new-tokens", "3")
    assert r.returncode == 0 and "tok/s" in r.stderr


def test_errors_are_one_clear_line(tmp_path):
    out = tmp_path / "m"
    assert ws("synth", "--preset", "tiny", "--dtype", "fp32", "--out", str(out)).returncode == 0
    cases = [
        (("generate", str(out), "--prompt-ids", "1,2", "--expert-cache", "0.5x"), "below one token's working set"),
        (("generate", str(out), "--prompt-ids", "1,x"), "comma-separated integers"),
        (("generate", str(out), "--prompt-ids", "1", "--expert-cache", "lots"), "not a size"),
        (("generate", str(out), "--prompt-ids", "99999"), "outside the vocabulary"),
        (("generate", str(tmp_path / "nope"), "--prompt-ids", "1"), "not a model directory"),
        (("synth", "--preset", "tiny", "--out", str(out)), "not empty"),
    ]
    for args, message in cases:
        r = ws(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
