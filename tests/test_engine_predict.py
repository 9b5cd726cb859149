"""Next-layer prediction: tokens stay exact, counters are timing-independent, and the guess beats chance."""

import json
import subprocess
import sys

import pytest

from weightstream.bench.runner import BenchConfig, child_config, run_child
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.presets import TINY

from engine_support import NEW_TOKENS, PROMPT, reference_tokens

ARCHS = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe")  # dense first layer + fp32 router; router bias; w1/w3 apart
SIZES = ("1x", "4x")
THREADS = (1, 2, 8)
COUNTERS = (
    "expert_hits",
    "expert_misses",
    "readahead_issued",
    "readahead_used",
    "readahead_wasted",
    "prediction_accuracy",
)  # bytes read are not here: how much of a cancelled read-ahead was read is timing


def run(model_dir, size, threads, predict_next=True, prompt=PROMPT):
    model = load_streaming_model(model_dir, expert_cache=size, io_threads=threads, predict_next=predict_next)
    try:
        new, stats = generate(model, prompt, NEW_TOKENS)
    finally:
        model.weightstream.close()
    return new[0].tolist(), stats, model.weightstream.cache


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_equal_eager_and_counters_do_not_depend_on_timing(tiny_model, arch):
    model_dir = tiny_model(arch)
    expected = reference_tokens(model_dir)
    for size in SIZES:
        seen = {}
        for threads in THREADS:
            tokens, stats, cache = run(model_dir, size, threads)
            assert tokens == expected, (arch, size, threads)
            assert stats.predict_next and stats.readahead_issued > 0
            assert stats.readahead_used + stats.readahead_wasted <= stats.readahead_issued
            # every byte read was a demand miss or a read-ahead (a cancelled one reads less), each its aligned span
            s = cache.stats
            assert s.aligned_bytes_missed <= stats.bytes_read <= s.aligned_bytes_missed + s.readahead_aligned_bytes
            seen[threads] = tuple(getattr(stats, c) for c in COUNTERS)
        # hits, misses and read-aheads are decided by the policy alone, never by which read landed first
        assert len(set(seen.values())) == 1, (arch, size, seen)


def test_prediction_beats_chance_and_turns_misses_into_hits(tiny_model):
    model_dir = tiny_model("olmoe")
    _, off, _ = run(model_dir, "1.5x", 2, predict_next=False)
    _, on, _ = run(model_dir, "1.5x", 2)
    top_k, experts = TINY["olmoe"]["num_experts_per_tok"], TINY["olmoe"]["num_experts"]
    assert on.prediction_accuracy > 2 * top_k / experts  # chance is k/E
    assert on.readahead_used > 0 and on.expert_hits > off.expert_hits
    assert on.expert_hits + on.expert_misses == off.expert_hits + off.expert_misses  # same demand lookups
    assert off.readahead_issued == 0 and off.prediction_accuracy == 0.0 and not off.predict_next


def test_page_cache_source_refuses_prediction(tiny_model):
    with pytest.raises(WeightstreamError, match="--predict-next needs --expert-source expert-cache"):
        load_streaming_model(tiny_model("olmoe"), expert_source="page-cache", predict_next=True)


def test_generate_flag_and_bench_passthrough(tiny_model):
    model_dir = tiny_model("gpt_oss")  # its router has a bias
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightstream.cli",
            "generate",
            model_dir,
            "--prompt-ids",
            "4,8,15,16",
            "--max-new-tokens",
            "6",
            "--expert-cache",
            "1x",
            "--predict-next",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["predict_next"] and stats["readahead_issued"] > 0 and 0 < stats["prediction_accuracy"] <= 1
    config = BenchConfig(model_dir, 0, ["1x"], ["expert-cache"], [[4, 8, 15, 16]], max_new_tokens=4, predict_next=True)
    result, err, rc = run_child(child_config(config, "expert-cache", "1x"), None)
    assert rc == 0, err
    assert result["prompts"][0]["readahead_issued"] > 0
