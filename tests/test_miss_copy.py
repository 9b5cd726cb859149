"""Small copies for misses (`quantize --miss-bits`, `--miss-copy`): the copies on disk are the Q2_K / Q3_K bytes of the
source weights, a miss reads one instead of the blob, an expert that comes back is read in full and from then on
computes exactly as in exact mode, each expert computes with its own copy's block types, results do not depend on
the I/O threads, and what cannot work is refused clearly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from weightstream.bench.child import run_streaming, warm_every_expert
from weightstream.bench.runner import summarize
from weightstream.cache.expert_cache import ExpertCache
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model, read_layout
from weightstream.errors import WeightstreamError
from weightstream.native import row_bytes
from weightstream.store.checkpoint import open_checkpoint, read_bytes
from weightstream.store.quant.ggml_blocks import ENCODERS
from weightstream.store.quant.manifest import MANIFEST, blob_key, read_manifest, small_key
from weightstream.store.quant.pipeline import quantize_checkpoint

from cli_support import refused_in_process
from engine_support import greedy_run

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
# every expert weight's inputs whole super-blocks of 256, so the copies are all Q2_K / Q3_K
WIDE = dict(hidden_size=256, moe_intermediate_size=256)
WIDE_OSS = dict(hidden_size=256, intermediate_size=256)
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def with_copies(tiny_model, tmp_path_factory):
    """with_copies(arch, miss_bits, bits=4, **shape) -> a quantized directory with small copies, built once."""
    built = {}

    def make(arch: str = "qwen3_moe", miss_bits: int = 2, bits: int = 4, **shape) -> str:
        shape = shape or (WIDE_OSS if arch == "gpt_oss" else WIDE)
        key = (arch, miss_bits, bits, tuple(sorted(shape.items())))
        if key not in built:
            out = str(tmp_path_factory.mktemp(f"miss{miss_bits}-{arch}") / "model")
            quantize_checkpoint(tiny_model(arch, "bf16", **shape), out, bits, miss_bits=miss_bits)
            built[key] = out
        return built[key]

    return make


def _source_weight(src: str, name: str) -> torch.Tensor:
    info = open_checkpoint(src).tensors[name]
    return read_bytes(info.path, info.offset, info.nbytes).view(torch.bfloat16).reshape(info.shape).float()


@pytest.mark.parametrize("miss_bits", [2, 3])
def test_quantize_writes_a_q2k_or_q3k_copy_beside_every_blob(tiny_model, with_copies, miss_bits):
    src, out = tiny_model("qwen3_moe", "bf16", **WIDE), with_copies("qwen3_moe", miss_bits)
    fmt = read_manifest(out)
    wtype = f"Q{miss_bits}_K"
    assert fmt.scheme == "q4_k" and fmt.miss_copy.bits == miss_bits and fmt.miss_copy.scheme == f"q{miss_bits}_k"
    assert [(t.name, t.dtype, t.shape) for t in fmt.miss_copy.tensors] == [
        ("gate_up_proj.qweight", wtype, (512, 256)),
        ("down_proj.qweight", wtype, (256, 256)),
    ]
    gate_up_bytes = 512 * row_bytes(wtype, 256)
    assert fmt.miss_copy.blob_bytes == -(-(gate_up_bytes + 256 * row_bytes(wtype, 256)) // 64) * 64
    # Q2_K 2.625 / Q3_K 3.4375 bits a weight against Q4_K's 4.5
    assert fmt.miss_copy.blob_bytes == {2: 84, 3: 110}[miss_bits] * fmt.blob_bytes // 144
    with open(f"{out}/{MANIFEST}") as f:
        assert json.load(f)["version"] == 3  # readers that know no small copies refuse it
    tensors = open_checkpoint(out).tensors
    blob, small = tensors[blob_key(EXPERTS, 5)], tensors[small_key(EXPERTS, 5)]
    assert small.dtype == "U8" and small.nbytes == fmt.miss_copy.blob_bytes and small.path == blob.path
    assert small.offset % 64 == 0 and blob.offset % 64 == 0
    gate = _source_weight(src, f"{EXPERTS}.5.gate_proj.weight")
    up = _source_weight(src, f"{EXPERTS}.5.up_proj.weight")
    raw = read_bytes(small.path, small.offset, gate_up_bytes)
    assert torch.equal(raw, ENCODERS[wtype](torch.cat([gate, up])).reshape(-1))  # from the source weights
    layout = read_layout(out)[1]
    assert len(layout.small_copies) == len(layout.experts)
    assert not any(name.endswith(".small") for name in layout.dense)  # never loaded as a dense tensor


def test_a_weight_whose_inputs_are_not_whole_super_blocks_falls_back_and_says_so(tiny_model, with_copies, tmp_path):
    out = with_copies("qwen3_moe", 2, hidden_size=256, moe_intermediate_size=64)
    fmt = read_manifest(out)
    assert [t.dtype for t in fmt.miss_copy.tensors] == ["Q2_K", "Q4_0"]  # down_proj has 64 inputs
    src = tiny_model("qwen3_moe", "bf16", hidden_size=256, moe_intermediate_size=64)
    r = _cli("quantize", src, "--bits", "4", "--miss-bits", "2", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert "small copies for misses: Q2_K" in r.stdout and "down_proj as Q4_0" in r.stdout
    tokens, _, _ = greedy_run(out, PROMPT, 4, expert_cache="1x", miss_copy=True)
    assert len(tokens) == PROMPT.shape[1] + 4


def _cache(model_dir: str, miss_copy: bool, io_threads: int = 2, upgrade_after: int | None = 1) -> ExpertCache:
    layout = read_layout(model_dir)[1]
    return ExpertCache(
        layout, 100 * layout.working_set_bytes, io_threads=io_threads, miss_copy=miss_copy, upgrade_after=upgrade_after
    )


def _fetch(cache: ExpertCache, layer: int, experts: list[int]):
    fetch = cache.fetch_layer(layer, experts)
    for _ in fetch.missing:
        cache.wait(fetch)
    return fetch


def _slot_bytes(cache: ExpertCache, layer: int, expert: int, name: str) -> torch.Tensor:
    return cache.params(layer, expert)[name].reshape(-1).clone()


def test_a_miss_reads_the_small_copy_and_the_next_lookup_reads_the_full_blob(with_copies):
    model_dir = with_copies("qwen3_moe", 2)
    exact, cache = _cache(model_dir, False), _cache(model_dir, True)
    try:
        layer = 1
        _fetch(exact, layer, [2, 5])
        first = _fetch(cache, layer, [2, 5])
        assert first.missing == [2, 5] and cache.stats.miss_copy_reads == 2 and cache.stats.upgrades == 0
        small = sum(cache.small_plans[(layer, e)].aligned_bytes for e in (2, 5))
        assert cache.stats.miss_copy_bytes == small == cache.stats.aligned_bytes_missed
        assert cache.bytes_read < 0.75 * exact.bytes_read  # the same misses, fewer bytes
        assert cache.holds_small_copy(layer, 5)
        tensors = open_checkpoint(model_dir).tensors
        on_disk = tensors[small_key(EXPERTS, 5)]
        stored = read_bytes(on_disk.path, on_disk.offset, on_disk.nbytes)
        got = _slot_bytes(cache, layer, 5, "gate_up_proj.qweight")
        assert torch.equal(got, stored[: got.numel()])  # the slot holds the small copy
        # looked up again while its small copy is resident: hot, read in full before the layer computes with it
        again = _fetch(cache, layer, [5, 7])
        assert sorted(again.missing) == [5, 7] and again.resident == []
        assert cache.stats.upgrades == 1 and cache.stats.upgrade_bytes == cache.plans[(layer, 5)].aligned_bytes
        assert cache.stats.hits == 1 and cache.stats.misses == 3  # an upgrade is a hit of the policy
        assert not cache.holds_small_copy(layer, 5) and cache.holds_small_copy(layer, 7)
        for name in ("gate_up_proj.qweight", "down_proj.qweight"):
            assert torch.equal(_slot_bytes(cache, layer, 5, name), _slot_bytes(exact, layer, 5, name))
        # full from then on: found resident, nothing read
        read = cache.bytes_read
        third = _fetch(cache, layer, [5])
        assert third.resident == [5] and third.missing == [] and cache.bytes_read == read
        assert cache.stats.upgrades == 1
    finally:
        exact.close()
        cache.close()


@pytest.mark.parametrize("upgrade_after", [2, None])
def test_upgrade_after_counts_the_hits_a_small_copy_takes_first(with_copies, upgrade_after):
    model_dir = with_copies("qwen3_moe", 2)
    layout = read_layout(model_dir)[1]
    cache = ExpertCache(
        layout, 100 * layout.working_set_bytes, io_threads=2, miss_copy=True, upgrade_after=upgrade_after
    )
    try:
        _fetch(cache, 1, [4])
        read = cache.bytes_read
        hit = _fetch(cache, 1, [4])  # computes with the small copy, reads nothing
        assert hit.resident == [4] and cache.bytes_read == read and cache.holds_small_copy(1, 4)
        assert cache.stats.miss_copy_hits == 1 and cache.stats.upgrades == 0
        again = _fetch(cache, 1, [4])
        if upgrade_after == 2:
            assert again.missing == [4] and cache.stats.upgrades == 1 and not cache.holds_small_copy(1, 4)
        else:  # never: the small copy stays until evicted
            assert again.resident == [4] and cache.stats.miss_copy_hits == 2 and cache.holds_small_copy(1, 4)
    finally:
        cache.close()


def _upgraded_run(model_dir: str, io_threads: int = 2):
    """Greedy logits with every expert read twice into a cache that holds them all (small copy, then upgraded)."""
    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=io_threads, miss_copy=True, upgrade_after=1)
    try:
        cache = model.weightstream.cache
        warm_every_expert(cache)
        assert len(cache.small) == len(cache.layout.experts)
        warm_every_expert(cache)
        assert not cache.small and cache.stats.upgrades == len(cache.layout.experts)
        with torch.inference_mode():
            out = model.generate(
                PROMPT, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        return out.sequences[0].tolist(), list(out.logits)
    finally:
        model.weightstream.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_every_expert_upgraded_computes_exactly_as_exact_mode(with_copies, arch):
    model_dir = with_copies(arch, 2)
    want_tokens, want_logits, _ = greedy_run(model_dir, PROMPT, expert_cache="100x", io_threads=2)
    tokens, logits = _upgraded_run(model_dir)
    assert tokens == want_tokens
    assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True))


def _reference(kernel, cache, layer, x, index, weights) -> torch.Tensor:
    """The layer's output from each routed expert's dequantized weights, those of the copy its slot holds."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            compute = kernel.small if cache.holds_small_copy(layer, e) else kernel
            params = cache.params(layer, e)
            gate_up = compute.dequantize(params["gate_up_proj.qweight"], name="gate_up_proj")
            down = compute.dequantize(params["down_proj.qweight"], name="down_proj")
            gate, up = (gate_up @ x[t].float()).chunk(2)
            out[t] += float(weights[t, k]) * (down @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [8, 64])  # the one-call layer (few rows an expert), expert by expert (many)
def test_a_layer_computes_each_expert_with_the_block_types_of_the_copy_it_holds(with_copies, tokens):
    model_dir = with_copies("qwen3_moe", 2)
    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2, miss_copy=True, upgrade_after=1)
    try:
        runtime = model.weightstream
        module, part = next((m, p) for m, p in runtime._parts.items() if p.layer == 1)
        cache = runtime.cache
        _fetch(cache, 1, [0, 1, 2, 3])  # small copies; looked up again below, they are upgraded, 4..7 missed
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, 256, generator=gen).to(model.dtype)
        index = torch.stack([torch.arange(tokens) % 8, (torch.arange(tokens) + 4) % 8], dim=1)
        weights = torch.rand(tokens, 2, generator=gen).to(model.dtype)
        with torch.inference_mode():
            got = runtime.experts_forward(module, x, index, weights).float()
        assert cache.stats.upgrades == 4 and cache.stats.miss_copy_reads == 8
        assert [cache.holds_small_copy(1, e) for e in range(8)] == [False] * 4 + [True] * 4
        want = _reference(part.kernel, cache, 1, x, index, weights)
        assert float((got - want).abs().max() / want.abs().max()) < 0.05  # 8-bit activations; wrong blocks: far off
    finally:
        model.weightstream.close()


def test_results_do_not_depend_on_the_io_threads(with_copies):
    model_dir = with_copies("qwen3_moe", 2)
    for size in ("1x", "1.5x"):
        want_tokens, want_logits, runtime = greedy_run(
            model_dir, PROMPT, expert_cache=size, io_threads=1, miss_copy=True, upgrade_after=1
        )
        assert runtime.cache.stats.miss_copy_reads > 0 and runtime.cache.stats.upgrades > 0
        for threads in (2, 8):
            tokens, logits, _ = greedy_run(
                model_dir, PROMPT, expert_cache=size, io_threads=threads, miss_copy=True, upgrade_after=1
            )
            assert tokens == want_tokens, (size, threads)
            assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True)), (size, threads)


def test_generate_stats_count_small_reads_and_upgrades(with_copies):
    model_dir = with_copies("qwen3_moe", 3)
    exact = load_streaming_model(model_dir, expert_cache="1x")
    model = load_streaming_model(model_dir, expert_cache="1x", miss_copy=True, upgrade_after=1)
    try:
        _, plain = generate(exact, PROMPT, 6)
        _, stats = generate(model, PROMPT, 6)
    finally:
        exact.weightstream.close()
        model.weightstream.close()
    assert plain.miss_copy_bits == 0 and plain.miss_copy_reads == plain.upgrades == 0
    assert stats.miss_copy_bits == 3 and stats.miss_copy_reads == stats.expert_misses > 0
    assert stats.upgrades > 0
    assert stats.miss_copy_bytes_read + stats.upgrade_bytes_read <= stats.bytes_read  # every read counted
    per_miss = stats.miss_copy_bytes_read / stats.miss_copy_reads
    assert per_miss < 0.85 * plain.bytes_read / plain.expert_misses  # Q3_K against Q4_K


def test_refusals_are_clear(tiny_model, with_copies, tmp_path):
    plain = str(tmp_path / "plain")
    quantize_checkpoint(tiny_model("qwen3_moe", "bf16", **WIDE), plain, 4)
    with pytest.raises(WeightstreamError, match="without small copies.*--miss-bits 2"):
        load_streaming_model(plain, miss_copy=True)
    with pytest.raises(WeightstreamError, match="not a quantized checkpoint.*--miss-bits 2"):
        load_streaming_model(tiny_model("qwen3_moe", "bf16", **WIDE), miss_copy=True)
    with pytest.raises(WeightstreamError, match="page-cache has no slots"):
        load_streaming_model(with_copies("qwen3_moe", 2), miss_copy=True, expert_source="page-cache")
    with pytest.raises(WeightstreamError, match="--miss-bits 5: choose 2"):
        quantize_checkpoint(tiny_model("qwen3_moe", "bf16", **WIDE), str(tmp_path / "a"), 4, miss_bits=5)
    narrow = tiny_model("qwen3_moe", "bf16")  # hidden 64, experts' intermediate 64: no weight can be Q2_K
    src = tiny_model("qwen3_moe", "bf16", **WIDE)
    cases = [
        (("quantize", src, "--bits", "4", "--miss-bits", "4", "--out", str(tmp_path / "b")), "invalid choice: 4"),
        (
            ("quantize", src, "--bits", "4", "--miss-bits", "2", "--kernel", "torch", "--out", str(tmp_path / "c")),
            "drop --kernel torch",
        ),
        (
            ("quantize", narrow, "--bits", "4", "--miss-bits", "2", "--out", str(tmp_path / "d")),
            "no expert weight has them (inputs: gate_up_proj 64, down_proj 64)",
        ),
        (
            ("quantize", with_copies("qwen3_moe", 2), "--bits", "4", "--miss-bits", "2", "--out", str(tmp_path / "e")),
            "already quantized (q4_k); quantize the original checkpoint (with --miss-bits there",
        ),
        (("generate", plain, "--prompt-ids", "1,2", "--miss-copy"), "--miss-bits 2 --out DIR"),
        (("generate", plain, "--prompt-ids", "1,2", "--upgrade-after", "2"), "--upgrade-after goes with --miss-copy"),
        (
            ("generate", plain, "--prompt-ids", "1,2", "--miss-copy", "--upgrade-after", "0"),
            "--upgrade-after 0: give a number of hits (1 or more) or never",
        ),
    ]
    for args, message in cases:
        code, stderr = refused_in_process(*args)
        assert code == 2 and message in stderr, (args, stderr)
    r = _cli(*cases[-1][0])  # and one through a new process, as a user runs it
    assert r.returncode == 2 and cases[-1][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing written by a refusal


def test_generate_labels_miss_copy_in_json_and_on_stderr(with_copies):
    model_dir = with_copies("qwen3_moe", 2)
    args = ("generate", model_dir, "--prompt-ids", "3,17,101", "--max-new-tokens", "4", "--expert-cache", "1x")
    r = _cli(*args, "--miss-copy", "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["miss_copy_bits"] == 2 and stats["miss_copy_reads"] == stats["expert_misses"] > 0
    assert "upgrades" in stats and "upgrade_bytes_read" in stats
    text = _cli(*args, "--miss-copy")
    assert text.returncode == 0, text.stderr
    assert text.stderr.count("tokens are not the model's exact ones") == 1
    assert "miss copies (Q2_K):" in text.stderr
    exact = _cli(*args)
    assert "miss copies" not in exact.stderr and "exact ones" not in exact.stderr


def test_bench_child_passes_miss_copy_and_its_summary_counts_it(with_copies):
    model_dir = with_copies("qwen3_moe", 2)
    cfg = {
        "mode": "expert-cache",
        "model_dir": model_dir,
        "expert_cache": "1x",
        "memory_limit": 0,
        "io_threads": 2,
        "prompts": [PROMPT[0].tolist()],
        "max_new_tokens": 4,
        "miss_copy": True,
    }
    result = run_streaming(cfg)
    result["peak_rss_bytes"] = 0
    out = summarize(result, None)
    assert out["miss_copy_bits"] == 2 and out["miss_copy_reads"] == out["expert_misses"] > 0


def test_serve_metrics_expose_miss_copy(with_copies):
    import httpx

    from serve_support import ServerProcess

    server = ServerProcess(with_copies("qwen3_moe", 2), "--expert-cache", "1x", "--miss-copy")
    try:
        server.wait_ready()
        body = {"model": "model", "prompt": PROMPT[0].tolist(), "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
        text = httpx.get(f"{server.url}/metrics").text
        assert "weightstream_miss_copy_bits 2.0" in text
        reads = next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("weightstream_miss_copy_reads_total")
        )
        assert reads > 0 and "weightstream_expert_upgrades_total" in text
        assert server.stderr.count("tokens are not the model's exact ones") == 1
    finally:
        server.kill()


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_the_default_upgrade_waits_for_the_eighth_hit(with_copies):
    """Without --upgrade-after a small copy serves its first seven hits and the eighth reads the full blob: the
    default that replayed real routing at 0.59-0.60x exact mode's bytes, where the first hit read 0.81-1.02x."""
    from weightstream.cache.sizes import DEFAULT_UPGRADE_AFTER

    assert DEFAULT_UPGRADE_AFTER == 8
    layout = read_layout(with_copies("qwen3_moe", 2))[1]
    cache = ExpertCache(layout, 100 * layout.working_set_bytes, io_threads=2, miss_copy=True)
    try:
        _fetch(cache, 1, [4])  # the miss: its small copy
        for hit in range(1, DEFAULT_UPGRADE_AFTER):
            again = _fetch(cache, 1, [4])
            assert again.resident == [4] and cache.stats.upgrades == 0 and cache.holds_small_copy(1, 4), hit
        eighth = _fetch(cache, 1, [4])
        assert eighth.missing == [4] and cache.stats.upgrades == 1 and not cache.holds_small_copy(1, 4)
    finally:
        cache.close()
