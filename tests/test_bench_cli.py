"""`weightstream bench` as a user runs it: every mode in its own cgroup, JSON on stdout, clear errors."""

import json
import os
import re
import subprocess
import sys

import pytest

from weightstream.io.pagecache import process_read_bytes

from cli_support import ran_in_process

ROOT = os.geteuid() == 0


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(not ROOT, reason="bench needs root for memory cgroups and the system-wide cache drop (CI is root)")
def test_bench_every_mode_under_a_limit_with_overlap_and_long_prefill(tiny_model):
    model_dir = tiny_model("olmoe", dtype="bf16")
    r = run_cli(
        "bench",
        model_dir,
        "--memory-limit",
        "2GiB",
        "--expert-cache",
        "1x,2x",
        "--modes",
        "expert-cache,page-cache,accelerate",
        "--max-new-tokens",
        "5",
        "--prefill-tokens",
        "40",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert "[bench] expert-cache 1x" in r.stderr  # progress goes to stderr, JSON alone to stdout
    report = json.loads(r.stdout)
    assert report["reference"] == "transformers in memory, no limit"
    runs = {(x["mode"], x["expert_cache"]): x for x in report["runs"]}
    assert set(runs) == {("expert-cache", "1x"), ("expert-cache", "2x"), ("page-cache", None), ("accelerate", None)}
    for run in runs.values():
        assert "error" not in run, run
        assert run["token_ids_equal_to_reference"] is True, run["mode"]
        assert run["decode_tokens_per_s"] > 0 and run["peak_rss_bytes"] > 0
        assert run["cgroup_peak_bytes"] <= 2 * 2**30
    for key in (("expert-cache", "1x"), ("expert-cache", "2x"), ("page-cache", None)):
        assert runs[key]["long_prefill"]["tokens"] == 40 and runs[key]["long_prefill"]["prefill_s"] > 0
    assert runs[("accelerate", None)]["long_prefill"] is None
    page = runs[("page-cache", None)]
    if process_read_bytes() is None:  # no task I/O accounting in this kernel: the figure is left out, not guessed
        assert "decode_bytes_read_per_token" not in page
    else:  # the kernel's count of all the child's reads a decode step: the model's pages it lacks, and code pages
        # faulted back in after a cache drop (the bench's, or another process's on a shared machine)
        assert 0 <= page["decode_bytes_read_per_token"] <= report["model_bytes"] + 64 * 2**20, page
    assert runs[("expert-cache", "1x")]["expert_hit_rate"] < runs[("expert-cache", "2x")]["expert_hit_rate"] <= 1
    overlap = report["overlap"]
    assert overlap["reader_bandwidth"]["mib_per_s"] > 0 and overlap["compute_only_misses"] == 0
    assert [o["expert_cache"] for o in overlap["runs"]] == ["1x", "2x"]
    for o in overlap["runs"]:
        assert o["bound_s"] == max(o["compute_only_s"], o["read_s"]) and o["ratio"] > 0
    assert "fixed_s" in report["cost_model"] or "error" in report["cost_model"]


@pytest.mark.skipif(not ROOT, reason="bench needs root for memory cgroups and the system-wide cache drop (CI is root)")
def test_bench_table_and_replay_reason_for_accelerate(tiny_model, tmp_path):
    model_dir = tiny_model("olmoe", dtype="bf16")
    trace, prompts = tmp_path / "t.npz", tmp_path / "p.txt"
    prompts.write_text("a tiny model routes these tokens\n")
    r = run_cli("trace", "record", model_dir, "--prompts", str(prompts), "--max-new-tokens", "4", "-o", str(trace))
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "bench",
        model_dir,
        "--memory-limit",
        "2GiB",
        "--expert-cache",
        "1x",
        "--modes",
        "direct,accelerate",
        "--routing-trace",
        str(trace),
        "--max-new-tokens",
        "3",
        "--prefill-tokens",
        "0",
        "--no-overlap",
    )
    assert r.returncode == 0, r.stderr
    assert "routing: replay of" in r.stdout
    assert re.search(r"^accelerate +not run: routing replay is not available", r.stdout, re.M), r.stdout


def test_bench_refuses_unknown_mode_and_bad_limit(tiny_model):
    """(The CLI's `main` in this process: refusals need no fresh interpreter.)"""
    model_dir = tiny_model("olmoe", dtype="bf16")
    code, _, err = ran_in_process("bench", model_dir, "--memory-limit", "2GiB", "--modes", "direct,turbo")
    assert code == 2 and "--modes: unknown mode 'turbo'" in err, err
    code, _, err = ran_in_process("bench", model_dir, "--memory-limit", "lots")
    assert code == 2 and "--memory-limit 'lots'" in err, err


@pytest.mark.skipif(not ROOT, reason="bench needs root for memory cgroups and the system-wide cache drop (CI is root)")
def test_bench_takes_a_quantized_directory(tiny_model, tmp_path):
    from weightstream.store.quant.pipeline import quantize_checkpoint

    out = str(tmp_path / "q4")
    quantize_checkpoint(tiny_model("olmoe", "bf16", intermediate_size=64), out, 4, 32)
    r = run_cli(
        "bench",
        out,
        "--memory-limit",
        "2GiB",
        "--expert-cache",
        "1x",
        "--modes",
        "expert-cache,page-cache,accelerate",
        "--max-new-tokens",
        "4",
        "--prefill-tokens",
        "0",
        "--no-overlap",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["reference"] == "weightstream with every quantized expert resident, no limit"
    runs = {x["mode"]: x for x in report["runs"]}
    assert runs["expert-cache"]["token_ids_equal_to_reference"] is True
    assert runs["page-cache"]["token_ids_equal_to_reference"] is True
    assert "cannot load weightstream's quantized experts" in runs["accelerate"]["error"]
