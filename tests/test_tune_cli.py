"""`weightstream tune` as a user runs it: one JSON answer, a command that runs, a saved calibration, clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightstream.cli import main
from weightstream.store.presets import preset_config
from weightstream.store.synth import synthesize

from _real_traces import deepseek


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny OLMoE of its own: tune writes its calibration next to it."""
    out = str(tmp_path_factory.mktemp("tune") / "model")
    synthesize(out, preset_config("tiny", "olmoe"), dtype="bf16", seed=2)
    return out


@pytest.fixture(scope="module")
def first_tune(model_dir, tmp_path_factory):
    plot = tmp_path_factory.mktemp("plot") / "tune.png"
    r = run_cli("tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6", "--plot", str(plot), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr, plot


def test_tune_answers_in_one_json_object(first_tune):
    report, stderr, plot = first_tune
    assert "built-in prompts" in report["routing"]["note"]  # says that real prompts give a better answer
    assert set(report["budget"]) >= {"dense_bytes", "kv_cache_bytes", "runtime_overhead_bytes", "expert_bytes"}
    assert report["calibration"]["source"] == "measured now" and report["cost_model"] == "overlap"
    paths = {c["path"] for c in report["configs"]}
    assert paths == {"expert-cache", "page-cache"}
    policies = {c["policy"] for c in report["configs"] if c["path"] == "expert-cache"}
    assert policies == {"lru", "slru", "lfu", "pinned", "adaptive", "belady"}
    for c in report["configs"]:
        assert {"cache_bytes", "hit_rate", "mib_read_per_token", "predicted_decode_tokens_per_s"} <= set(c)
        assert c["predicted_decode_tokens_per_s"] > 0 and 0 <= c["hit_rate"] <= 1
        assert c["cache_bytes"] <= report["budget"]["expert_bytes"]
    rec = report["recommendation"]
    assert rec["command"][:3] == ["weightstream", "generate", report["model"]]
    assert (
        rec["predicted_decode_tokens_per_s"]
        == max(c["predicted_decode_tokens_per_s"] for c in report["configs"] if not c["bound"])
        or "LRU within" in rec["reason"]
    )
    assert any("llama.cpp" in line for line in report["llama_cpp"])
    assert plot.stat().st_size > 0 and "[tune] calibrating" in stderr


def test_calibration_times_each_miss_level_it_routes(first_tune, model_dir):
    """The saved measurements: the cache counted exactly the misses per layer that each routed level asked for
    (top-2 of 8 experts here: one partial level; the all-miss run's fresh sets may meet experts an earlier run left
    resident, which it counts as hits)."""
    (entry,) = json.loads((Path(model_dir) / ".weightstream" / "calibration.json").read_text())["entries"]
    m = entry["measurements"]
    assert m["partial_miss_per_layer"] == [1.0] and 1.0 < m["miss_per_layer"] <= 2.0
    assert 0 < m["partial_miss_step_s"][0] and 0 < m["decode_step_s"] < m["miss_step_s"]


def test_the_recommended_command_runs(first_tune):
    command = first_tune[0]["recommendation"]["command"]
    r = run_cli(*command[1:], "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == int(command[command.index("--max-new-tokens") + 1])


def test_the_next_tune_reuses_the_calibration_and_a_pinned_answer_runs(first_tune, model_dir, capsys):
    assert main(["tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6", "--policies", "pinned", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["source"].startswith("saved ")
    rec = report["recommendation"]
    if rec["path"] == "expert-cache":  # the page cache may be predicted faster on this tiny model
        assert rec["policy"] == "pinned" and rec["pinned_experts_file"] in rec["command"]
        r = run_cli(*rec["command"][1:])
        assert r.returncode == 0, r.stderr


def test_a_trace_of_the_model_and_a_bench_cost_model(first_tune, model_dir, tmp_path, capsys):
    trace = first_tune[0]["routing"]["saved_to"]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"cost_model": {"fixed_s": 0.02, "per_mib_s": 0.001, "r2": 0.9, "points": 8}}))
    assert main(["tune", model_dir, "--memory", "1GiB", "--trace", trace, "--cost-model", str(bench), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cost_model"] == "linear (bench)" and report["routing"]["source"] == "trace"
    expert = [c for c in report["configs"] if c["path"] == "expert-cache"]
    c = expert[0]
    assert 1 / c["predicted_decode_tokens_per_s"] == pytest.approx(0.02 + 0.001 * c["mib_read_per_token"])


def test_clear_errors(model_dir, tmp_path, capsys):
    def error(*args) -> str:
        assert main(["tune", model_dir, *args]) == 2
        return capsys.readouterr().err

    assert "no expert cache fits. Use --memory" in error("--memory", "300MiB")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert str(bad) in error("--memory", "1GiB", "--trace", str(bad))
    ds = tmp_path / "ds.npz"
    from weightstream.trace import save

    save(deepseek(1), ds)
    assert "64 experts per layer; this model has 8" in error("--memory", "1GiB", "--trace", str(ds))
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    assert "no cost model in it" in error("--memory", "1GiB", "--cost-model", str(junk))
    assert "unknown ['fifo']" in error("--memory", "1GiB", "--policies", "lru,fifo")
    assert "--forget-calibrations: only with --calibrate" in error("--memory", "1GiB", "--forget-calibrations")


def test_pinned_policy_needs_its_experts(model_dir, tmp_path, capsys):
    assert main(["generate", model_dir, "--prompt-ids", "1,2", "--policy", "pinned"]) == 2
    assert "--pinned-experts FILE" in capsys.readouterr().err
    keys = tmp_path / "pinned.json"
    keys.write_text(json.dumps({"pinned_experts": np.array([[0, 1], [1, 2]]).tolist()}))
    args = ["generate", model_dir, "--prompt-ids", "1,2", "--policy", "pinned", "--pinned-experts", str(keys)]
    assert main([*args, "--expert-cache", "2x", "--max-new-tokens", "3"]) == 0
    keys.write_text(json.dumps({"pinned_experts": [[0, e] for e in range(8)] + [[1, e] for e in range(8)]}))
    assert main([*args, "--expert-cache", "2x"]) == 2
    assert "leave no free slot" in capsys.readouterr().err


def test_calibration_saves_the_readahead_around_a_lone_expert(first_tune, model_dir):
    """[ahead, past] bytes for each span of an expert, carried into the cost parameters the page-cache model reads.
    (This model's files are a few pages: the dense weights' mapping holds its neighbours, so the bytes may be 0.)"""
    from weightstream.commands.tune_steps import TuneSession
    from weightstream.units import GIB

    (entry,) = json.loads((Path(model_dir) / ".weightstream" / "calibration.json").read_text())["entries"]
    readahead = entry["measurements"]["page_readahead"]
    facts = TuneSession(model_dir, GIB, 512, 4).facts
    assert len(readahead) == len(facts.spans[0][facts.n_experts // 2])
    assert all(ahead >= 0 and past >= 0 for ahead, past in readahead)
    assert entry["params"]["page_readahead"] == readahead


def test_the_readahead_around_a_lone_expert_is_what_the_fault_brought_in(tiny_model, no_proactive_reclaim):
    """Experts of 768 KiB, a layer's file 6 MiB: the kernel reads around the middle expert's fault (any window
    above 0), never more than the file, and the pages it brought in are counted, not those resident before."""
    from weightstream.bench.calibrate import Calibrator
    from weightstream.bench.machine import read_ahead_bytes
    from weightstream.commands.tune_steps import TuneSession
    from weightstream.units import GIB

    session = TuneSession(tiny_model("olmoe", "bf16", intermediate_size=2048), GIB, 512, 2)
    calibrator = Calibrator(session.engine(), 2, None)
    calibrator.prime = False
    ((ahead, past),) = calibrator.page_readahead()  # OLMoE keeps an expert in one span
    path = session.layout.experts[(session.layout.layers[0], 4)].pieces[0].path
    assert read_ahead_bytes(path) > 0
    assert 0 < ahead + past <= max(session.facts.file_bytes)


def test_dense_spans_hold_what_a_step_reads_of_the_dense_weights(model_dir):
    from weightstream.commands.tune_steps import TuneSession
    from weightstream.sim.budget import lazy_dense_bytes
    from weightstream.units import GIB

    session = TuneSession(model_dir, GIB, 512, 4)
    groups = session.facts.dense_spans
    assert len(groups) == session.facts.layers + 1  # before each routed layer's experts, then the head
    assert all(groups[:-1]) and groups[-1]  # every layer has attention and a router; the head its weight
    dense = {name: t.nbytes for name, t in session.layout.dense.items()}
    total = sum(b - a for g in groups for _, a, b in g)
    assert total == pytest.approx(sum(dense.values()) - lazy_dense_bytes(dense, False), abs=4096 * len(dense))


def test_calibrations_add_up_and_forget_drops_them(first_tune, model_dir, capsys):
    """A second --calibrate is saved beside the first and tune prices with the median of both (two: their mean);
    --forget-calibrations keeps the new one alone. The text answer says how many calibrations it used."""
    store = Path(model_dir) / ".weightstream" / "calibration.json"
    args = ["tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6", "--policies", "lru", "--calibrate"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    first, second = json.loads(store.read_text())["entries"]
    assert report["calibration"]["samples"] == 2 and report["calibration"]["measured_params"] == second["params"]
    for term in ("dense_s", "read_s_per_mib", "nonoverlap_s_per_mib"):
        both = (first["params"][term] + second["params"][term]) / 2
        assert report["calibration"]["params"][term] == pytest.approx(both)
    assert main(["tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6", "--policies", "lru"]) == 0
    assert "median of this machine's last 2 calibrations" in capsys.readouterr().out
    assert main([*args, "--forget-calibrations", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (only,) = json.loads(store.read_text())["entries"]
    assert report["calibration"]["samples"] == 1 and report["calibration"]["params"] == only["params"]
