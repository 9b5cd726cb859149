"""`simulate` and `tune` model `--miss-copy`: the simulator's small reads, upgrades, small hits and bytes are what the
real expert cache counts on the same lookups, at every upgrade setting; `simulate --miss-copy-ratio` reports them and
refuses bad input clearly; `tune` prices small copies apart from the exact answer and says what they would save where
a checkpoint has none."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from weightstream.cache.expert_cache import ExpertCache
from weightstream.cache.policy import split_waves
from weightstream.cli import main
from weightstream.engine.loader import read_layout
from weightstream.sim import Workload, replay
from weightstream.sim.miss_copy import MissCopy
from weightstream.sim.replay import Options, run_one
from weightstream.store.quant.pipeline import quantize_checkpoint
from weightstream.trace import ModelShape, Trace, TraceWriter, save

from cli_support import refused_in_process

WIDE = dict(hidden_size=256, moe_intermediate_size=256)  # every weight's inputs whole blocks: Q2_K copies


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """quantized(miss_bits) -> a Q4_K tiny qwen3_moe, with Q2_K small copies (2) or without (None), built once."""
    built = {}

    def make(miss_bits: int | None) -> str:
        if miss_bits not in built:
            out = str(tmp_path_factory.mktemp(f"q4-miss{miss_bits}") / "model")
            quantize_checkpoint(tiny_model("qwen3_moe", "bf16", **WIDE), out, 4, miss_bits=miss_bits)
            built[miss_bits] = out
        return built[miss_bits]

    return make


def skewed_trace(shape: ModelShape, requests: int = 6, decode: int = 14, seed: int = 0) -> Trace:
    """Requests of a batched prefill step (3 or 4 tokens) then one-token steps, experts drawn with a skew, so that
    experts come back while resident (small-copy hits, upgrades) and after eviction (a small copy again)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, shape.n_experts + 1) ** 1.2
    w = TraceWriter(shape)
    for r in range(requests):
        perm = rng.permutation(shape.n_experts)  # each request its own favourites
        for step in range(decode + 1):
            tokens = int(rng.integers(3, 5)) if step == 0 else 1
            w.begin_step(r, "prefill" if step == 0 else "decode", tokens)
            for layer in shape.layers:
                chosen = []
                for _ in range(tokens):
                    p = weights[perm] / weights.sum()
                    chosen += rng.choice(shape.n_experts, size=shape.top_k, replace=False, p=p).tolist()
                w.add(layer, chosen)
    return w.finish()


def layout_trace(layout, **kw) -> Trace:
    """A skewed trace in the checkpoint's own shape: expert bytes are each expert's full blob."""
    sizes = [layout.experts[(layer, 0)].nbytes for layer in layout.layers]
    return skewed_trace(ModelShape("tiny", layout.layers, min(layout.num_experts.values()), layout.top_k, sizes), **kw)


def drive(cache: ExpertCache, trace: Trace) -> None:
    """Every step's layers through the real cache as the runtime calls it: token by token, in waves, misses awaited."""
    offsets, layers, experts = trace.group_offsets.tolist(), trace.group_layer.tolist(), trace.experts.tolist()
    for g, layer in enumerate(layers):
        for wave in split_waves(experts[offsets[g] : offsets[g + 1]], cache.n_slots):
            fetch = cache.fetch_layer(layer, wave)
            for _ in fetch.missing:
                cache.wait(fetch)


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
@pytest.mark.parametrize("size", [1.0, 1.5, 2.5])
def test_the_simulator_counts_what_the_real_cache_reads_with_small_copies(quantized, policy, size):
    layout = read_layout(quantized(2))[1]
    trace = layout_trace(layout)
    blob = layout.experts[(layout.layers[0], 0)].nbytes
    small = layout.small_copies[(layout.layers[0], 0)].nbytes
    settings = (1, 2, None)
    counted = {}
    for upgrade_after in settings:
        cache = ExpertCache(
            layout,
            int(size * layout.working_set_bytes),
            policy=policy,
            io_threads=2,
            miss_copy=True,
            upgrade_after=upgrade_after,
        )
        try:
            drive(cache, trace)
        finally:
            cache.close()
        counted[upgrade_after] = (cache.stats, cache.n_slots)
    (n_slots,) = {n for _, n in counted.values()}
    # the policy sees a small copy's hits as hits: hits and misses do not depend on the setting
    assert len({(s.hits, s.misses) for s, _ in counted.values()}) == 1
    for method in ("fast", "reference"):
        sim = replay(trace, policy, n_slots * blob, method=method, miss_copy=MissCopy(small / blob, settings))
        for m in sim.miss_copy:
            stats = counted[m.upgrade_after][0]
            assert (sim.hits, sim.misses) == (stats.hits, stats.misses)
            assert (m.small_reads, m.upgrades, m.small_hits) == (
                stats.miss_copy_reads,
                stats.upgrades,
                stats.miss_copy_hits,
            ), (method, m.upgrade_after)
            assert m.bytes_read == stats.expert_bytes_missed  # small copies' bytes + full blobs' bytes
    stats_1, stats_2, stats_never = (counted[n][0] for n in settings)
    # the sequence exercises what differs: upgrades at the first and second hit, small hits, experts evicted and
    # read again as small copies (more small reads than distinct experts)
    assert stats_1.upgrades > stats_2.upgrades > 0 and stats_2.miss_copy_hits > 0
    assert stats_never.upgrades == 0 and stats_never.miss_copy_hits > stats_2.miss_copy_hits
    assert stats_1.miss_copy_reads > len(set(Workload(trace).keys.tolist()))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    shape = ModelShape("synthetic", [0, 1, 2, 3], 16, 2, [3 * 2**20] * 4)
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    save(skewed_trace(shape, requests=8, decode=20, seed=1), path)
    return path


def test_simulate_reports_miss_copy_per_upgrade_setting(trace_file):
    res = _cli(
        "simulate", str(trace_file), "--json", "--policies", "lru,slru", "--sizes", "1x,2x",
        "--miss-copy-ratio", "0.58", "--upgrade-after", "1,never,2",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["miss_copy"] == {"ratio": 0.58, "exact": False}
    from weightstream.trace import load

    w = Workload(load(trace_file), 0.5)
    for r in out["results"]:
        assert [m["upgrade_after"] for m in r["miss_copy"]] == [1, "never", 2]
        want = run_one(w, r["policy"], r["cache_bytes"], Options(), miss_copy=MissCopy(0.58, (1, None, 2))).to_json()
        assert r == want
        one, never, two = r["miss_copy"]
        assert all(m["small_reads"] == r["misses"] for m in r["miss_copy"])
        assert never["upgrades"] == 0 and never["bytes_vs_exact"] == pytest.approx(0.58, abs=1e-6)
        # never upgraded: every hit is on a small copy, counted once per lookup call (a prefill lists some twice)
        assert 0 < never["small_hits"] <= r["hits"]
        assert one["small_hits"] == 0 and one["upgrades"] > 0 and one["upgrades"] >= two["upgrades"]
        assert never["bytes_per_token"] <= two["bytes_per_token"] <= one["bytes_per_token"]
    table = _cli(
        "simulate", str(trace_file), "--policies", "lru", "--sizes", "1x", "--miss-copy-ratio", "0.58"
    )  # default settings: 1, 2, 4, never
    assert table.returncode == 0, table.stderr
    assert "NOT exact" in table.stdout and "never" in table.stdout and "upgrade" in table.stdout
    plain = json.loads(_cli("simulate", str(trace_file), "--json", "--policies", "lru", "--sizes", "1x").stdout)
    assert "miss_copy" not in plain and "miss_copy" not in plain["results"][0]


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--miss-copy-ratio=-0.1"],
            "--miss-copy-ratio -0.1: a small copy's bytes over its full blob's must be above 0",
        ),
        (["--miss-copy-ratio", "0"], "--miss-copy-ratio 0: a small copy's bytes over its full blob's must be above 0"),
        (["--miss-copy-ratio", "1"], "must be above 0 and below 1; give e.g. 0.58 for Q2_K copies"),
        (["--miss-copy-ratio", "1.5"], "--miss-copy-ratio 1.5: a small copy's bytes"),
        (["--miss-copy-ratio", "half"], "--miss-copy-ratio 'half': not a number"),
        (["--miss-copy-ratio", "0.58", "--upgrade-after", "0"], "--upgrade-after 0: give numbers of hits (1 or more"),
        (["--miss-copy-ratio", "0.58", "--upgrade-after", "1,soon"], "--upgrade-after soon: give numbers of hits"),
        (["--miss-copy-ratio", "0.58", "--upgrade-after", ","], "--upgrade-after ',': no setting; give e.g. 1,2,4"),
        (["--upgrade-after", "2"], "--upgrade-after goes with --miss-copy-ratio"),
    ],
)
def test_simulate_refuses_bad_miss_copy_input_naming_the_option(trace_file, args, says):
    code, err = refused_in_process("simulate", trace_file, "--policies", "lru", "--sizes", "1x", *args)
    assert code == 2 and says in err, err


def test_miss_copy_options_are_checked_in_the_library_too():
    with pytest.raises(Exception, match="--upgrade-after 0"):
        MissCopy(0.5, (0,))
    with pytest.raises(Exception, match="above 0 and below 1"):
        MissCopy(1.0)


def _line(path) -> str:
    """A bench cost model: tune prices without calibrating (nothing timed), and fast reads make small copies pay."""
    path.write_text(json.dumps({"cost_model": {"fixed_s": 0.002, "per_mib_s": 0.01, "r2": 0.9, "points": 8}}))
    return str(path)


def _tune(model_dir: str, tmp_path, capsys, *extra) -> dict:
    layout = read_layout(model_dir)[1]
    trace = tmp_path / "routing.npz"
    save(layout_trace(layout, requests=4, decode=12, seed=5), trace)
    args = ["tune", model_dir, "--memory", "1GiB", "--trace", str(trace), "--cost-model", _line(tmp_path / "l.json")]
    assert main([*args, "--policies", "lru,slru", *extra]) == 0
    return capsys.readouterr().out


def test_tune_prices_miss_copy_apart_and_recommends_it_separately(quantized, tmp_path, capsys):
    model_dir = quantized(2)
    report = json.loads(_tune(model_dir, tmp_path, capsys, "--json"))
    small = report["miss_copy"]
    assert small["available"] and small["exact"] is False and "NOT exact" in small["label"]
    assert small["small_copy_bits"] == 2 and 0.5 < small["small_copy_ratio"] < 0.65
    assert small["upgrade_after"] == [1, 2, 4, 8, "never"]
    # never among the exact configurations, never the exact recommendation
    assert not any(c.get("miss_copy") for c in report["configs"])
    assert "--miss-copy" not in report["recommendation"]["command"]
    exact = {(c["policy"], c["cache_bytes"]): c for c in report["configs"] if c["path"] == "expert-cache"}
    for c in small["configs"]:
        same = exact[(c["policy"], c["cache_bytes"])]
        assert c["hit_rate"] == same["hit_rate"] and c["exact_mib_read_per_token"] == same["mib_read_per_token"]
        if c["upgrade_after"] == "never":
            assert c["mib_read_per_token"] == pytest.approx(small["small_copy_ratio"] * same["mib_read_per_token"])
            assert c["upgrades_per_token"] == 0
        # the line's price of what it reads
        assert 1 / c["predicted_decode_tokens_per_s"] == pytest.approx(0.002 + 0.01 * c["mib_read_per_token"])
    rec = small["recommendation"]
    assert rec["predicted_decode_tokens_per_s"] == max(c["predicted_decode_tokens_per_s"] for c in small["configs"])
    at = rec["command"].index("--miss-copy")
    assert rec["command"][at + 1 : at + 3] == ["--upgrade-after", str(rec["upgrade_after"])]
    r = _cli(*rec["command"][1:], "--max-new-tokens", "3", "--json")  # the command runs
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["miss_copy_bits"] == 2
    text = _tune(model_dir, tmp_path, capsys)
    assert "recommendation with --miss-copy (NOT exact: tokens differ from the model's)" in text
    assert "--miss-copy --upgrade-after" in text and "upgrade after" in text
    assert text.index("recommendation: expert-cache") < text.index("recommendation with --miss-copy")


def test_tune_says_what_small_copies_would_save_where_there_are_none(quantized, tiny_model, tmp_path, capsys):
    report = json.loads(_tune(quantized(None), tmp_path, capsys, "--json"))
    hint = report["miss_copy"]
    assert hint["available"] is False and 0.5 < hint["estimated_small_copy_ratio"] < 0.65
    read = hint["mib_read_per_token"]
    assert read["never"] == pytest.approx(hint["estimated_small_copy_ratio"] * read["exact"])
    assert "--miss-bits 2" in hint["line"] and "NOT exact" in hint["line"]
    assert f"{read['never']:.1f} MiB with --upgrade-after never" in _tune(quantized(None), tmp_path, capsys)
    bf16 = tiny_model("qwen3_moe", "bf16", **WIDE)  # not quantized: no small copies to suggest from its blobs
    assert json.loads(_tune(bf16, tmp_path, capsys, "--json"))["miss_copy"] is None
