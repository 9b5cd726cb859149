"""`weightstream tune` as a user runs it: one JSON answer, a command that runs, a saved calibration, clear errors."""

import json
import os
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
    largest = max(c["cache_bytes"] for c in report["configs"] if c["path"] == "expert-cache")
    if rec["path"] == "expert-cache" and rec["cache_bytes"] == largest and rec["policy"] != "pinned":
        # the whole budget: the engine sizes it itself from tune's own --memory (docs/memory.md)
        assert rec["command"][rec["command"].index("--memory") + 1] == f"{report['budget']['memory_bytes'] // 2**20}MiB"
    elif rec["path"] == "expert-cache":
        assert int(rec["command"][rec["command"].index("--expert-cache") + 1]) == rec["cache_bytes"]
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


def test_the_next_tune_reuses_the_calibration_and_a_pinned_answer_runs(first_tune, model_dir, tmp_path, capsys):
    args = ["tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6", "--policies", "pinned", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["calibration"]["source"].startswith("saved ")
    # the page cache may be predicted faster on this tiny model: a bench line far faster than any page-cache step
    # prices the expert cache, so that the answer is the pinned cache whatever this machine measured
    fast = _bench_json(tmp_path / "fast.json", fixed_s=1e-6, per_mib_s=1e-9)
    trace = first_tune[0]["routing"]["saved_to"]
    assert main([*args, "--trace", trace, "--cost-model", fast]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert (rec["path"], rec["policy"]) == ("expert-cache", "pinned")
    assert rec["command"][rec["command"].index("--pinned-experts") + 1] == rec["pinned_experts_file"]
    pinned = json.loads(Path(rec["pinned_experts_file"]).read_text())
    assert len(pinned["pinned_experts"]) > 0 and pinned["slots"] == rec["slots"]
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
    assert "--gpu-memory 'lots': not a size" in error("--memory", "1GiB", "--gpu-memory", "lots")


def _bench_json(path: Path, **terms) -> str:
    path.write_text(json.dumps({"cost_model": {"r2": 0.9, "points": 8, **terms}}))
    return str(path)


@pytest.mark.parametrize(
    "terms, named",
    [
        ({"fixed_s": 0, "per_mib_s": 0}, "fixed_s 0"),  # would predict infinite speed
        ({"fixed_s": 0.0, "per_mib_s": 0.001}, "fixed_s 0"),  # a step that reads nothing: infinite speed
        ({"fixed_s": -0.5, "per_mib_s": 0.001}, "fixed_s -0.5"),
        ({"fixed_s": 0.02, "per_mib_s": -0.001}, "per_mib_s -0.001"),
        ({"fixed_s": float("nan"), "per_mib_s": 0.001}, "fixed_s nan"),
        ({"fixed_s": 0.02, "per_mib_s": float("inf")}, "per_mib_s inf"),
        ({"fixed_s": 0.02, "per_mib_s": "fast"}, "per_mib_s 'fast'"),
    ],
)
def test_a_nonsense_cost_model_is_refused_naming_the_file_and_the_term(
    first_tune, model_dir, tmp_path, capsys, terms, named
):
    trace = first_tune[0]["routing"]["saved_to"]
    bench = _bench_json(tmp_path / "bench.json", **terms)
    assert main(["tune", model_dir, "--memory", "1GiB", "--trace", trace, "--cost-model", bench]) == 2
    err = capsys.readouterr().err
    assert f"--cost-model {bench}: {named}" in err and "weightstream bench --json" in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--policies", ",,,"], "--policies ',,,': no policy; choose from lru, slru, lfu, pinned, adaptive"),
        (["--policies", " "], "--policies ' ': no policy; choose from lru, slru, lfu, pinned, adaptive"),
        (["--policies", "belady"], "unknown ['belady']; choose from lru, slru, lfu, pinned, adaptive"),
        (["--io-threads", "0"], "--io-threads 0: need at least 1"),
        (["--io-threads", "-2"], "--io-threads -2: need at least 1"),
        (["--gpu-memory", "0"], "--gpu-memory 0: need more than 0 bytes"),
    ],
)
def test_empty_and_nonpositive_arguments_are_refused_before_any_work(
    first_tune, model_dir, tmp_path, capsys, args, says
):
    trace = first_tune[0]["routing"]["saved_to"]
    bench = _bench_json(tmp_path / "bench.json", fixed_s=0.02, per_mib_s=0.001)
    argv = ["tune", model_dir, "--memory", "1GiB", "--trace", trace, "--cost-model", bench, *args]
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_a_policy_named_twice_is_searched_once(first_tune, model_dir, tmp_path, capsys):
    trace = first_tune[0]["routing"]["saved_to"]
    bench = _bench_json(tmp_path / "bench.json", fixed_s=0.02, per_mib_s=0.001)
    argv = ["tune", model_dir, "--memory", "1GiB", "--trace", trace, "--cost-model", bench, "--json"]
    assert main([*argv, "--policies", "lru, lru,slru,"]) == 0
    configs = [c for c in json.loads(capsys.readouterr().out)["configs"] if c["path"] == "expert-cache"]
    sizes = sorted({c["cache_bytes"] for c in configs})
    assert sorted((c["cache_bytes"], c["policy"]) for c in configs) == sorted(
        (s, p) for s in sizes for p in ("lru", "slru", "belady")
    )


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
    """[ahead, past] bytes for each span of an expert, carried into the cost parameters the page-cache model reads:
    whole pages (the median of 3 passes x 3 layers is one of them), never before the file's start nor past its end
    around the experts calibration faulted. (This model's files are a few pages: the dense weights' mapping holds
    its neighbours, so the bytes may be 0.)"""
    from weightstream.bench.calibrate import READAHEAD_PASSES
    from weightstream.cache.slot_plan import merge_spans
    from weightstream.tune.session import TuneSession
    from weightstream.units import GIB, PAGE

    (entry,) = json.loads((Path(model_dir) / ".weightstream" / "calibration.json").read_text())["entries"]
    readahead = entry["measurements"]["page_readahead"]
    assert entry["params"]["page_readahead"] == readahead
    session = TuneSession(model_dir, GIB, 512, 4)
    layout, facts = session.layout, session.facts
    assert READAHEAD_PASSES * len(layout.layers) % 2 == 1
    faulted = [facts.n_experts * (i + 1) // (READAHEAD_PASSES + 1) for i in range(READAHEAD_PASSES)]
    spans = []  # each faulted expert's spans: (room before it in its file, room after it), page-aligned as mincore
    for layer in layout.layers:
        for e in faulted:
            pieces = layout.experts[(layer, e)].pieces
            names = sorted({p.path for p in pieces})
            merged = merge_spans(((names.index(p.path), p.offset, p.nbytes) for p in pieces), 4096)
            size = {f: os.path.getsize(names[f]) for f, _, _ in merged}
            spans.append([(a // PAGE * PAGE, (-(-size[f] // PAGE) + b // -PAGE) * PAGE) for f, a, b in merged])
    assert len(readahead) == len(spans[0]) == len(facts.spans[0][facts.n_experts // 2])
    for i, (ahead, past) in enumerate(readahead):
        assert ahead % PAGE == 0 and past % PAGE == 0
        assert 0 <= ahead <= max(s[i][0] for s in spans) and 0 <= past <= max(s[i][1] for s in spans)


def test_the_readahead_around_a_lone_expert_is_what_the_fault_brought_in(tiny_model):
    """Experts of 768 KiB, a layer's file 6 MiB: the kernel reads around the middle expert's fault (any window
    above 0), never more than the file, and the pages it brought in are counted, not those resident before.
    (Proactive reclaim is paused for this test alone: the module-wide fixture left it off for the tests after it,
    whose calibration key then named another machine state than the first calibration's.)"""
    from weightstream.bench.calibrate import Calibrator
    from weightstream.bench.machine import read_ahead_bytes
    from weightstream.bench.reclaim import paused_proactive_reclaim
    from weightstream.tune.session import TuneSession
    from weightstream.units import GIB

    session = TuneSession(tiny_model("olmoe", "bf16", intermediate_size=2048), GIB, 512, 2)
    calibrator = Calibrator(session.engine(), 2, None)
    calibrator.prime = False
    with paused_proactive_reclaim():
        ((ahead, past),) = calibrator.page_readahead()  # OLMoE keeps an expert in one span
    path = session.layout.experts[(session.layout.layers[0], 4)].pieces[0].path
    assert read_ahead_bytes(path) > 0
    assert 0 < ahead + past <= max(session.facts.file_bytes)


def test_dense_spans_hold_what_a_step_reads_of_the_dense_weights(model_dir):
    from weightstream.sim.budget import lazy_dense_bytes
    from weightstream.tune.session import TuneSession
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


def test_the_table_says_small_sizes_in_units_that_scale_down(first_tune, model_dir):
    """Issue 52, case 11: a tiny model's caches are KiB, not 0.00 GiB in every row."""
    r = run_cli("tune", model_dir, "--memory", "1GiB", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "0.00 GiB" not in r.stdout and " KiB" in r.stdout, r.stdout
    header = next(line for line in r.stdout.splitlines() if "policy" in line and "hit rate" in line)
    assert "cache GiB" not in header and "cache" in header
