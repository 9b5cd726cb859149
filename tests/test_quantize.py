"""Quantized experts: the math against straightforward references, the bytes on disk against what the kernel
takes, streamed against resident bitwise, and `weightstream quantize` as a user runs it (atomic, bounded, clear)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.presets import TINY
from weightstream.store.quant.manifest import MANIFEST, blob_key, read_manifest
from weightstream.store.quant.pipeline import quantize_checkpoint
from weightstream.store.quant.torch_codes import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    torch_int4_layout,
    unpack_int4,
)

from cli_support import ran_in_process, refused_in_process
from engine_support import greedy_run
from rss_support import peak_over_baseline

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """quantized(arch, bits, dtype, kernel) -> directory of the tiny model's experts quantized, built once: torch's
    layouts (int4 in groups of 32) or GGML blocks for the native kernels (Q8_0, Q4_1: hidden 64 is no Q4_K)."""
    built = {}

    def make(arch: str, bits: int, dtype: str = "bf16", kernel: str = "torch") -> str:
        key = (arch, bits, dtype, kernel)
        if key not in built:
            out = str(tmp_path_factory.mktemp(f"q{bits}-{arch}-{dtype}-{kernel}") / "model")
            group = 32 if bits == 4 and kernel == "torch" else None
            quantize_checkpoint(tiny_model(arch, dtype), out, bits, group, kernel=kernel)
            built[key] = out
        return built[key]

    return make


def test_int8_matches_a_per_row_reference():
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(w, torch.float32)
    for row in range(24):
        scale = w[row].abs().max() / 127
        assert torch.equal(q[row], torch.round(w[row] / scale).clamp(-127, 127).to(torch.int8))
    assert torch.allclose(dequantize_int8(q, s), w, atol=float(s.max()) / 2 + 1e-7)


def test_int4_matches_a_per_group_reference_and_round_trips():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    q, sz = quantize_int4(w, 32, torch.float32)
    assert sz.shape == (4, 32, 2) and q.min() >= 0 and q.max() <= 15
    for row in range(32):
        for g in range(4):
            chunk = w[row, g * 32 : (g + 1) * 32]
            scale = (chunk.max() - chunk.min()) / 15
            want = torch.round((chunk - chunk.min()) / scale).clamp(0, 15)
            assert (q[row, g * 32 : (g + 1) * 32] - want).abs().max() <= 1  # the stored zero is rounded once
            assert sz[g, row, 0] == scale
    assert (dequantize_int4(q, sz, 32) - w).abs().max() <= sz[:, :, 0].max() * 0.51 + 1e-6


@pytest.mark.parametrize("shape", [(2048, 128), (64, 64), (208, 64), (16, 32)])  # full blocks, a tail, tail only
def test_int4_packing_is_torchs_and_unpacks(shape):
    q = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    layout = torch_int4_layout()
    if layout is None:  # a pack_int4 wrong in every layout also fails every int4 load (manifest without a layout)
        pytest.skip("this machine's torch packs int4 in none of the layouts known here (INT4_LAYOUTS)")
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(pack_int4(q, layout), packed)
    assert torch.equal(unpack_int4(packed, layout).to(torch.int32), q)


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_on_disk_are_what_the_kernel_takes(tiny_model, quantized, bits):
    src, out = tiny_model("qwen3_moe", "bf16"), quantized("qwen3_moe", bits)
    fmt = read_manifest(out)
    blob = open_checkpoint(out).tensors[blob_key("model.layers.1.mlp.experts", 5)]
    with open(blob.path, "rb") as f:
        f.seek(blob.offset)
        raw = torch.frombuffer(bytearray(f.read(blob.nbytes)), dtype=torch.uint8)
    src_ckpt = open_checkpoint(src).tensors
    gate = _tensor(src_ckpt["model.layers.1.mlp.experts.5.gate_proj.weight"])
    up = _tensor(src_ckpt["model.layers.1.mlp.experts.5.up_proj.weight"])
    gate_up = torch.cat([gate, up])  # the model's layout: (2I, D)
    t = fmt.tensor("gate_up_proj.qweight")
    stored = raw[t.offset : t.offset + t.nbytes]
    if bits == 8:
        expected = quantize_int8(gate_up, torch.bfloat16)[0]
    else:
        expected = torch._convert_weight_to_int4pack_for_cpu(quantize_int4(gate_up, 32, torch.bfloat16)[0], 1)
    assert torch.equal(stored, expected.reshape(-1).view(torch.uint8))
    assert blob.offset % 64 == 0 and all(t.offset % 64 == 0 for t in fmt.tensors)


def _tensor(info):
    with open(info.path, "rb") as f:
        f.seek(info.offset)
        raw = bytearray(f.read(info.nbytes))
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16).reshape(info.shape)


def _logits(model_dir, **kwargs):
    return greedy_run(model_dir, PROMPT, **kwargs)


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", sorted(TINY))
def test_streamed_logits_equal_resident_bitwise(quantized, arch, bits, kernel):
    model_dir = quantized(arch, bits, kernel=kernel)
    tokens, logits, runtime = _logits(model_dir, expert_cache="100x", io_threads=2)
    name = f"int{bits}-packed" if kernel == "torch" else f"{'q8_0' if bits == 8 else 'q4_1'}-native"
    assert runtime.kernels and all(k == name for k in runtime.kernels.values())
    for size in ("1x", "1.5x", "4x"):
        for threads in (1, 2, 8):
            got_tokens, got_logits, _ = _logits(model_dir, expert_cache=size, io_threads=threads)
            assert got_tokens == tokens, (arch, bits, size, threads)
            assert all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True)), (arch, bits, size)
    page_tokens, page_logits, _ = _logits(model_dir, expert_source="page-cache")
    assert page_tokens == tokens and all(torch.equal(g, w) for g, w in zip(page_logits, logits, strict=True))


def test_fp32_checkpoints_quantize_too(quantized):
    model_dir = quantized("mixtral", 4, "fp32")
    tokens, logits, _ = _logits(model_dir, expert_cache="100x", io_threads=2)
    got, got_logits, _ = _logits(model_dir, expert_cache="1x", io_threads=2)
    assert got == tokens and logits[0].dtype == torch.float32
    assert all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True))


def test_quantized_expert_sizes_and_stats(tiny_model, quantized):
    src = tiny_model("olmoe", "bf16")
    bf16 = load_streaming_model(src, expert_cache="1x")
    q4 = load_streaming_model(quantized("olmoe", 4), expert_cache="1x")
    try:
        expert = next(iter(bf16.weightstream.layout.experts.values())).nbytes
        blob = next(iter(q4.weightstream.layout.experts.values())).nbytes
        assert blob == read_manifest(quantized("olmoe", 4)).blob_bytes and blob < 0.4 * expert
        _, stats = generate(q4, PROMPT, 4)
        assert stats.expert_misses > 0 and stats.bytes_read > 0
    finally:
        bf16.weightstream.close()
        q4.weightstream.close()


def test_trace_record_and_simulate_take_a_quantized_directory(quantized, tmp_path):
    model_dir = quantized("qwen3_moe", 4)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the cache holds quantized experts\n")
    out = tmp_path / "t.npz"
    run = _cli("trace", "record", model_dir, "--prompts", str(prompts), "--max-new-tokens", "3", "-o", str(out))
    assert run.returncode == 0, run.stderr
    info = json.loads(_cli("trace", "info", str(out), "--json").stdout)
    assert set(info["shape"]["expert_bytes"]) == {read_manifest(model_dir).blob_bytes}
    sim = _cli("simulate", str(out), "--json", "--train-share", "0", "--sizes", "1x,2x")
    assert sim.returncode == 0, sim.stderr


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_refuses_bad_input_and_changes_nothing(tiny_model, quantized, tmp_path):
    src = tiny_model("olmoe", "bf16")
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine too")
    narrow = tiny_model("olmoe", "bf16", intermediate_size=40)
    cases = [
        (("quantize", src, "--bits", "4", "--out", str(existing)), "exists and is not empty"),
        (("quantize", src, "--bits", "4", "--group-size", "48", "--out", str(tmp_path / "a")), "--group-size 48"),
        (("quantize", src, "--bits", "4", "--group-size", "0", "--out", str(tmp_path / "a")), "--group-size 0"),
        (("quantize", src, "--bits", "8", "--group-size", "64", "--out", str(tmp_path / "b")), "for --bits 4"),
        (("quantize", quantized("olmoe", 8), "--bits", "4", "--out", str(tmp_path / "c")), "already quantized"),
        (
            ("quantize", narrow, "--bits", "8", "--kernel", "torch", "--out", str(tmp_path / "d")),
            "40 inputs; int8 experts need a multiple of 16 (no int8 or int4 scheme fits",
        ),
        (("quantize", narrow, "--bits", "8", "--out", str(tmp_path / "e")), "q8_0 needs inputs in whole blocks of 32"),
        (("quantize", src, "--bits", "4", "--kernel", "cuda", "--out", str(tmp_path / "f")), "invalid choice"),
        (("quantize", src, "--bits", "16", "--kernel", "torch", "--out", str(tmp_path / "g")), "drop --kernel torch"),
        (
            ("quantize", narrow, "--bits", "16", "--out", str(tmp_path / "h")),
            "bf16 needs inputs in whole blocks of 32 (run the checkpoint as it is",
        ),
        (("quantize", src, "--bits", "8", "--dense", "fp8", "--out", str(tmp_path / "i")), "invalid choice"),
        (("quantize", src, "--bits", "8", "--out", str(a_file)), "exists and is a file"),
        (("quantize", src, "--bits", "8", "--out", str(a_file), "--force"), "exists and is a file"),
        (("quantize", src, "--bits", "8", "--out", str(existing), "--force"), "weightstream did not write it"),
        (("synth", "--preset", "tiny", "--out", str(a_file), "--force"), "exists and is a file"),
        (("synth", "--preset", "tiny", "--out", str(existing), "--force"), "weightstream did not write it"),
    ]
    for args, message in cases:
        code, stderr = refused_in_process(*args)
        assert code == 2 and message in stderr, (args, stderr)
    r = _cli(*cases[0][0])  # and one through a new process, as a user runs it
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(existing) == ["keep.txt"] and a_file.read_text() == "mine too"
    assert sorted(os.listdir(tmp_path)) == ["a-file", "taken"]  # no output, no leftover temp dir


def test_force_replaces_only_what_weightstream_wrote(tiny_model, tmp_path):
    """The review's case: `quantize par/src --out par --force` deleted the source and par/mine.txt. (The CLI's
    `main` in this process: five commands without starting torch five times.)"""
    import shutil

    par = tmp_path / "par"
    src = par / "src"
    shutil.copytree(tiny_model("olmoe", "bf16"), src)
    (par / "mine.txt").write_text("unrelated")
    before = sorted(os.listdir(src))
    for out, message in ((par, "holds the source"), (src, "is the source")):
        code, _, err = ran_in_process("quantize", src, "--bits", "8", "--out", out, "--force")
        assert code == 2 and message in err, err
    assert sorted(os.listdir(src)) == before and (par / "mine.txt").read_text() == "unrelated"
    assert sorted(os.listdir(par)) == ["mine.txt", "src"]

    out = tmp_path / "q"
    assert ran_in_process("quantize", src, "--bits", "8", "--out", out)[0] == 0
    code, stdout, err = ran_in_process(
        "quantize", src, "--bits", "4", "--group-size", "32", "--out", out, "--force", "--json"
    )
    assert code == 0 and json.loads(stdout)["group_size"] == 32, err  # its own output: replaced
    assert read_manifest(str(out)).scheme == "int4"
    (out / "notes.txt").write_text("the user's")
    code, _, err = ran_in_process("quantize", src, "--bits", "8", "--out", out, "--force")
    assert code == 2 and "notes.txt" in err, err
    assert (out / "notes.txt").read_text() == "the user's" and read_manifest(str(out)).scheme == "int4"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no work or set-aside directory left


def test_the_tiny_preset_quantizes_and_every_hint_is_a_command_that_works(tmp_path):
    """`synth --preset tiny` (hidden 64) quantizes with the native kernels (Q8_0, Q4_1); with torch's, the
    default int4 group (128) is refused with a hint, and the hinted flags then work (the CLI's `main` in this
    process: the commands as a user types them, without starting torch six times)."""
    src = str(tmp_path / "tiny")
    assert ran_in_process("synth", "--preset", "tiny", "--out", src)[0] == 0
    for bits in ("8", "4"):
        code, out, err = ran_in_process("quantize", src, "--bits", bits, "--out", tmp_path / f"q{bits}", "--json")
        assert code == 0 and json.loads(out)["scheme"] == {"8": "q8_0", "4": "q4_1"}[bits], err
    code, _, err = ran_in_process("quantize", src, "--kernel", "torch", "--bits", "4", "--out", tmp_path / "t4")
    assert code == 2 and "(use --bits 4 --group-size 64 or --bits 8)" in err, err
    flags = err.split("(use ")[1].split(")")[0].split(" or ")
    for i, hint in enumerate(flags):
        code, _, err = ran_in_process(
            "quantize", src, "--kernel", "torch", *hint.split(), "--out", tmp_path / f"hint{i}"
        )
        assert code == 0, (hint, err)


def test_a_damaged_manifest_or_wrong_scales_are_refused_naming_the_file(quantized, tmp_path):
    import shutil

    model_dir = str(tmp_path / "m")
    shutil.copytree(quantized("olmoe", 4), model_dir)
    path = os.path.join(model_dir, MANIFEST)
    good = json.loads(open(path).read())
    with open(path, "w") as f:
        f.write('{"format": "weightstream-quantized-experts", "version": 1, "scheme": ')
    with pytest.raises(WeightstreamError, match=f"{MANIFEST}: damaged quantization manifest"):
        load_streaming_model(model_dir)
    bad = json.loads(json.dumps(good))
    scales = next(t for t in bad["tensors"] if t["name"] == "down_proj.scales")
    scales["shape"] = [scales["shape"][1], scales["shape"][0], 2]  # same bytes, groups and channels swapped
    json.dump(bad, open(path, "w"))
    with pytest.raises(WeightstreamError, match=rf"{MANIFEST}: scales of 'down_proj.qweight' are bfloat16\["):
        load_streaming_model(model_dir)
    bad = json.loads(json.dumps(good))
    bad["blob_bytes"] += 64
    json.dump(bad, open(path, "w"))
    with pytest.raises(WeightstreamError, match=r"expert blob 'model\.layers\.0\.mlp\.experts\.0\.packed' is U8 of"):
        load_streaming_model(model_dir)


def test_killed_midway_leaves_nothing_that_loads(tmp_path):
    """SIGKILL during the run: no --out directory; the hidden work directory has no manifest, so it never loads
    as a quantized checkpoint (and the next run is unaffected)."""
    from weightstream.store.presets import preset_config
    from weightstream.store.synth import synthesize

    src = str(tmp_path / "src")
    synthesize(
        src,
        {
            **preset_config("tiny", "qwen3_moe"),
            "hidden_size": 512,
            "moe_intermediate_size": 512,
            "num_experts": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "head_dim": 64,
        },
        dtype="bf16",
        seed=3,
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightstream.cli", "quantize", src, "--bits", "4", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and not any(p.endswith(".safetensors") for d in tmp_path.glob(".quantize-*") for p in os.listdir(d))
    ):
        time.sleep(0.05)
    if proc.poll() == 0:  # the whole run fit between two looks: a machine this fast needs a bigger model
        pytest.skip("quantize finished before it could be killed mid-write")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = list(tmp_path.glob(".quantize-*"))
    assert not out.exists() and leftovers, "killed before it started writing: make the model bigger"
    assert not any((d / MANIFEST).exists() for d in leftovers)
    for d in leftovers:
        with pytest.raises(WeightstreamError):
            load_streaming_model(str(d))
    r = _cli("quantize", src, "--bits", "4", "--out", str(out))
    assert r.returncode == 0 and read_manifest(str(out)) is not None, r.stderr


def test_peak_rss_is_bounded_on_a_model_whose_experts_are_16x_the_bound(tmp_path):
    """quantize holds one expert at a time: peak RSS stays within baseline + largest dense tensor + a bound of
    96 MiB (one expert's float32 working copies and the blob), for experts totalling 16x that bound.

    Measured with glibc told to map every buffer over 128 KiB on its own, so the figure is quantize's working set
    (36 MiB here at 8, 64 and 160 experts a layer) and not the heap's fragmentation: with glibc's default dynamic
    threshold the heap adds 40-60 MiB that depends on timing and levels off (74 MiB at 8 experts a layer,
    80-92 at 64, 89-91 at 160), once enough to cross this bound by 1.5 MiB. Forcing the threshold in quantize
    itself would make it 3x slower (a fresh mapping, zeroed, for every temporary)."""
    from weightstream.store.presets import preset_config
    from weightstream.store.synth import synthesize

    bound = 96 * 2**20
    src = str(tmp_path / "src")
    fields = {
        **preset_config("tiny", "qwen3_moe"),
        "hidden_size": 1024,
        "moe_intermediate_size": 1024,
        "num_experts": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "head_dim": 128,
        "vocab_size": 512,
    }
    synthesize(src, fields, dtype="bf16", seed=4)
    experts = sum(t.nbytes for t in open_checkpoint(src).tensors.values() if ".experts." in t.name)
    dense_max = max(t.nbytes for t in open_checkpoint(src).tensors.values() if ".experts." not in t.name)
    assert experts >= 16 * bound
    code = (
        "import json, sys; import torch, transformers; from weightstream.bench.child import peak_rss; "
        "from weightstream.store.model import map_model; map_model(sys.argv[1]); base = peak_rss(); "
        "from weightstream.store.quant.pipeline import quantize_checkpoint; "
        "quantize_checkpoint(sys.argv[1], sys.argv[2], 4); print(json.dumps([base, peak_rss()]))"
    )
    base, peak = peak_over_baseline(code, src, str(tmp_path / "out"))
    assert peak - base <= dense_max + bound, (peak - base) / 2**20


@pytest.mark.parametrize("layout", ["avx512", "avx2", "pairs"])
@pytest.mark.parametrize("shape", [(2048, 128), (208, 64), (16, 32)])
def test_every_int4_layout_round_trips(layout, shape):
    """Only this machine's layout can be held to torch's packer (above); all three must invert exactly."""
    q = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    packed = pack_int4(q, layout)
    assert packed.shape == (shape[0], shape[1] // 2)
    assert torch.equal(unpack_int4(packed, layout).to(torch.int32), q)


def test_a_foreign_int4_layout_is_refused_naming_the_fix(quantized, tmp_path):
    import shutil

    model_dir = str(tmp_path / "m")
    shutil.copytree(quantized("olmoe", 4), model_dir)
    path = os.path.join(model_dir, MANIFEST)
    manifest = json.loads(open(path).read())
    manifest["int4_layout"] = next(name for name in ("avx512", "avx2", "pairs") if name != torch_int4_layout())
    json.dump(manifest, open(path, "w"))
    with pytest.raises(WeightstreamError, match="run `weightstream quantize` again on this machine"):
        load_streaming_model(model_dir)


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_the_default_4_bit_formats_stream_bitwise_as_resident(tiny_model, tmp_path, kernel):
    """The tiny models take neither default: torch's int4 groups of 128 need inputs of 128 or more, the native
    Q4_K super-blocks of 256 (every other compute test runs groups of 32 and Q4_1)."""
    src = tiny_model("qwen3_moe", "bf16", hidden_size=256, moe_intermediate_size=256, head_dim=64)
    out = str(tmp_path / kernel)
    quantize_checkpoint(src, out, 4, kernel=kernel)
    fmt = read_manifest(out)
    assert (fmt.scheme, fmt.group_size) == (("int4", 128) if kernel == "torch" else ("q4_k", None))
    tokens, logits, _ = _logits(out, expert_cache="100x", io_threads=2)
    for size, threads in (("1x", 1), ("1.5x", 8)):
        got_tokens, got_logits, _ = _logits(out, expert_cache=size, io_threads=threads)
        assert got_tokens == tokens and all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True))


@pytest.mark.parametrize("bits", [8, 4])
def test_the_dequantize_route_for_many_rows_is_the_dequantized_product(quantized, bits):
    """From DEQUANT_ROWS rows a projection multiplies by the dequantized weight: bitwise F.linear of it, and
    within the load-time tolerance of the packed kernel's rows."""
    import torch.nn.functional as F

    from weightstream.engine.kernels.choice import QUANT_TOLERANCE, quantized_kernel_for
    from weightstream.engine.kernels.quantized import DEQUANT_ROWS
    from weightstream.store.layout import experts_modules
    from weightstream.store.model import map_model

    mapped = map_model(quantized("olmoe", bits))
    kernel = quantized_kernel_for(next(iter(experts_modules(mapped.model).values())), mapped.quant)
    expert = next(iter(mapped.layout.experts.values()))
    params = {}
    for p in expert.params:
        raw = torch.cat([_read(piece.path, piece.offset, piece.nbytes) for piece in p.pieces])
        params[p.name] = raw.view(p.dtype).reshape(p.shape)
    rows = DEQUANT_ROWS[f"int{bits}"]
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q, scales = params["gate_up_proj.qweight"], params["gate_up_proj.scales"]
    many = kernel.project(x, params, "gate_up_proj")
    assert torch.equal(many, F.linear(x, kernel.dequantize(q, scales)))
    few = torch.cat([kernel.project(x[i : i + 1], params, "gate_up_proj") for i in range(4)])  # packed kernel
    assert float((few - many[:4]).abs().max() / many[:4].abs().max()) < QUANT_TOLERANCE


def _read(path, offset, nbytes):
    with open(path, "rb") as f:
        f.seek(offset)
        return torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.uint8)


def test_the_load_time_check_refuses_a_kernel_that_computes_wrong(tiny_model, monkeypatch):
    """torch's int8 kernel returns wrong values, without an error, for bf16 inputs not a multiple of 16 on CPUs with
    AVX-512 (on AVX2 alone it is right); a manifest that slipped such a shape past quantize's own check is caught by
    the load-time comparison where the kernel is wrong, and passes it where it is right. A kernel made wrong on
    purpose is refused on every CPU."""
    from weightstream.engine.kernels.choice import quantized_kernel_for
    from weightstream.engine.kernels.quantized import PackedExperts
    from weightstream.store.layout import experts_modules
    from weightstream.store.model import map_model
    from weightstream.store.quant.manifest import QuantFormat, blob_layout

    mapped = map_model(tiny_model("olmoe", "bf16", intermediate_size=40))
    module = next(iter(experts_modules(mapped.model).values()))
    entries = [
        ("gate_up_proj.qweight", "int8", (80, 64)),
        ("gate_up_proj.scales", "bfloat16", (80,)),
        ("down_proj.qweight", "int8", (64, 40)),
        ("down_proj.scales", "bfloat16", (64,)),
    ]
    table, nbytes = blob_layout(entries)
    quant = QuantFormat("int8", "bfloat16", table, nbytes)
    refused = r"the int8-packed kernel is off by \S+% .* \(more than 3%"
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (64, 40), generator=gen, dtype=torch.int8)
    scales = torch.rand(64, generator=gen).mul(0.01).bfloat16()
    # torch's kernel reads past the end of such rows (what it reads decides the answer: right at times, inf at
    # others), so one product says little: 20 tries of each row count tell a wrong kernel from a right one
    torch_is_wrong = False
    for _ in range(20):
        for rows in (1, 3):  # the row counts of the packed route the check runs
            x = torch.randn(rows, 40, generator=gen).bfloat16()
            want = x.float() @ (q.float() * scales.float()[:, None]).T
            got = torch._weight_int8pack_mm(x, q.clone(), scales.clone()).float()
            torch_is_wrong |= not bool((got - want).abs().max() <= 0.03 * want.abs().max())
    if torch_is_wrong:  # each check runs several products: one of five refusing is all but certain
        refusals = 0
        for _ in range(5):
            try:
                quantized_kernel_for(module, quant)
            except WeightstreamError as e:
                assert re.search(refused, str(e)), e
                refusals += 1
        assert refusals >= 1, "the load-time check passed a kernel that computes wrong here, five times"
    else:
        assert quantized_kernel_for(module, quant).name == "int8-packed"
    right = PackedExperts.product
    monkeypatch.setattr(PackedExperts, "product", lambda self, x, p, name: right(self, x, p, name) * 1.1)
    with pytest.raises(WeightstreamError, match=refused):
        quantized_kernel_for(module, quant)


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_dense_weights_quantized_run_natively_and_stream_bitwise(tiny_model, tmp_path, dense):
    """`--dense`: attention, shared experts and the untied head become GGML blocks run by NativeLinear; the
    router stays as it was; streamed equals resident bitwise, and the answer stays near the dense-keep model's."""
    from weightstream.engine.kernels.dense import NativeLinear

    src = tiny_model("qwen2_moe", "bf16")
    out = str(tmp_path / dense)
    quantize_checkpoint(src, out, 8, dense=dense)
    fmt = read_manifest(out)
    names = set(fmt.dense)
    assert {t for t, _ in fmt.dense.values()} == {"Q8_0" if dense == "int8" else "Q4_1"}
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert.down_proj.weight" in names
    assert not any(n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) for n in names)
    model = load_streaming_model(out, expert_cache="1x")
    try:
        linears = {n for n, m in model.named_modules() if isinstance(m, NativeLinear)}
        assert {f"{n.removesuffix('.weight')}" for n in names} == linears
    finally:
        model.weightstream.close()
    tokens, logits, _ = _logits(out, expert_cache="100x", io_threads=2)
    for size, threads in (("1x", 1), ("1.5x", 8)):
        got_tokens, got_logits, _ = _logits(out, expert_cache=size, io_threads=threads)
        assert got_tokens == tokens and all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True))
    keep = str(tmp_path / "keep")
    quantize_checkpoint(src, keep, 8)
    _, keep_logits, _ = _logits(keep, expert_cache="100x", io_threads=2)
    first, ref = logits[0].float(), keep_logits[0].float()
    assert float((first - ref).abs().max() / ref.abs().max()) < (
        0.03 if dense == "int8" else 0.2
    )  # measured 0.9% and 9.8%


def _stored(model_dir: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(open_checkpoint(model_dir).tensors[name].path, "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_bf16_blocks_keep_the_weights_and_run_every_product_natively(tiny_model, tmp_path, arch):
    """`--bits 16 --dense bf16`: experts and dense linears become BF16 rows (the source's bytes, nothing rounded)
    run by the native kernels in float32; streamed equals resident bitwise at every cache size and thread count,
    and the logits stay near the bf16 model's, which rounds every step to bf16 where this keeps float32."""
    from weightstream import native
    from weightstream.engine.kernels.dense import NativeLinear

    src = tiny_model(arch, "bf16")
    out = str(tmp_path / "bf16n")
    quantize_checkpoint(src, out, 16, dense="bf16")
    fmt = read_manifest(out)
    assert fmt.scheme == "bf16" and {t.dtype for t in fmt.tensors if len(t.shape) == 2} == {"BF16"}
    assert {t for t, _ in fmt.dense.values()} == {"BF16"}
    # the blob holds the source's bf16 weights as they were
    name, (_, (n, k)) = next(iter(fmt.dense.items()))
    stored = native.dequantize(_stored(out, name).reshape(-1), "BF16", n, k)
    assert torch.equal(stored, _stored(src, name).float())
    tokens, logits, runtime = _logits(out, expert_cache="100x", io_threads=2)
    assert runtime.kernels and all(k == "bf16-native" for k in runtime.kernels.values())
    assert logits[0].dtype == torch.float32
    model = load_streaming_model(out, expert_cache="1x")
    try:
        assert sum(isinstance(m, NativeLinear) for m in model.modules()) == len(fmt.dense)
    finally:
        model.weightstream.close()
    for size, threads in (("1x", 1), ("1.5x", 8)):
        got_tokens, got_logits, _ = _logits(out, expert_cache=size, io_threads=threads)
        assert got_tokens == tokens and all(torch.equal(g, w) for g, w in zip(got_logits, logits, strict=True))
    _, ref_logits, _ = _logits(src, expert_cache="100x", io_threads=2)
    first, ref = logits[0], ref_logits[0].float()
    assert float((first - ref).abs().max() / ref.abs().max()) < 0.02  # measured 0.4% and 0.6%: bf16 rounding


def test_generate_reports_the_weight_bytes_a_decode_token_touches(tiny_model, tmp_path):
    """Batch-1 decode multiplies by every dense weight but the untied input embedding, and by top-k experts in
    every MoE layer: with --dense the dense share is the blocks' bytes."""
    src = tiny_model("olmoe", "bf16")
    out = str(tmp_path / "d8")
    quantize_checkpoint(src, out, 4, dense="int8")
    model = load_streaming_model(out, expert_cache="1x")
    try:
        layout = model.weightstream.layout
        dense = sum(t.nbytes for n, t in layout.dense.items() if not n.endswith("embed_tokens.weight"))
        expert = next(iter(layout.experts.values())).nbytes
        _, stats = generate(model, PROMPT, 5)
    finally:
        model.weightstream.close()
    assert stats.weight_bytes_per_token == dense + len(layout.num_experts) * layout.top_k * expert
    assert dense < sum(t.nbytes for t in open_checkpoint(src).tensors.values() if ".experts." not in t.name) / 1.5


def test_serve_answers_from_a_quantized_checkpoint_as_generate_does(tiny_model, tmp_path):
    """serve on native Q4_1 experts and Q8_0 dense weights: a greedy completion's text is generate's, over HTTP."""
    import httpx

    from weightstream.engine.loader import load_tokenizer

    from serve_support import ServerProcess

    out = str(tmp_path / "q")
    quantize_checkpoint(tiny_model("qwen3_moe", "bf16"), out, 4, dense="int8")
    model = load_streaming_model(out, expert_cache="1x")
    try:
        new, _ = generate(model, PROMPT, 6)
    finally:
        model.weightstream.close()
    want = load_tokenizer(out, required=True).decode(new[0].tolist(), skip_special_tokens=True)
    server = ServerProcess(out, "--expert-cache", "1x")
    try:
        server.wait_ready()
        body = {"model": "q", "prompt": PROMPT[0].tolist(), "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        server.kill()
