"""The native kernels (csrc/qmm.cpp) against independent references: GGML's block formats as the `gguf` package
decodes them, float products, each other (AVX2 against portable, bitwise), and thread counts."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from weightstream.engine import native
from weightstream.store.ggml_quant import ENCODERS

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _blocks(wtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random rows of blocks: encoded from Gaussian weights where gguf can encode the type, else random bytes
    with sane fp16 scales (every code and scale pattern the decoder must read)."""
    rng = np.random.default_rng(seed)
    kind = getattr(GGMLQuantizationType, wtype)
    if wtype in ("Q8_0", "Q4_0", "Q4_1"):
        return quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), kind)
    block, size = quants.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, size=(n, k // block, 2)).astype(np.float16).view(np.uint8)
    if wtype == "Q4_K":
        raw[..., 0:4] = scales.reshape(n, k // block, 4)
    else:
        raw[..., 208:210] = scales[..., :2]
    return raw.reshape(n, -1)


def test_the_build_made_the_extension():
    """`make test` builds the extension (pip, --no-build-isolation); every test here needs it."""
    assert native.available(), native.why_not()


@pytest.mark.parametrize("wtype", TYPES)
def test_dequantize_is_bitwise_ggufs_reference(wtype):
    n, k = 48, 512
    raw = _blocks(wtype, n, k)
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, wtype)).reshape(n, k)
    got = native.dequantize(torch.from_numpy(raw).reshape(-1), wtype, n, k)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("wtype", TYPES)
def test_products_avx2_equal_portable_bitwise_and_are_close_to_float(wtype):
    n, k = 72, 768 if wtype in ("Q8_0", "Q4_0", "Q4_1") else 512
    w = torch.from_numpy(_blocks(wtype, n, k, seed=1)).reshape(-1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    portable = native.qmm(x, w, wtype, n, k, "portable")
    if native.best_path() == "avx2":
        assert torch.equal(native.qmm(x, w, wtype, n, k, "avx2"), portable)
    exact = x.double() @ native.dequantize(w, wtype, n, k).double().t()
    # 8-bit activations: each block's error is at most half a step of 127 per value
    assert float((portable.double() - exact).abs().max() / exact.abs().max()) < 0.02


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_K"])
def test_a_rows_result_depends_on_nothing_but_its_row_and_the_weights(wtype):
    """Same bits with 1 or 2 threads, alone or batched with other rows: streamed equals resident on that."""
    n, k = 256, 512
    w = torch.from_numpy(_blocks(wtype, n, k, seed=3)).reshape(-1)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.qmm(x, w, wtype, n, k)
        torch.set_num_threads(2)
        two = native.qmm(x, w, wtype, n, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(native.qmm(x[2:3], w, wtype, n, k), two[2:3])


@pytest.mark.parametrize("wtype", sorted(ENCODERS))
def test_our_encoders_write_what_gguf_decodes(wtype):
    """quantize's encoders: the blocks decode (by gguf's reference) to within the format's step of the input."""
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(5)) * 0.03
    raw = ENCODERS[wtype](w)
    back = quants.dequantize(raw.numpy(), getattr(GGMLQuantizationType, wtype)).reshape(32, 512)
    rms = float(np.sqrt(((back - w.numpy()) ** 2).mean() / (w.numpy() ** 2).mean()))
    assert rms < {"Q8_0": 0.01, "Q4_0": 0.1, "Q4_1": 0.1, "Q4_K": 0.1, "Q6_K": 0.03}[wtype], rms
    assert np.array_equal(native.dequantize(raw.reshape(-1), wtype, 32, 512).numpy(), back)


def test_bad_shapes_are_refused_not_read_past():
    w = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not whole blocks of 32"):
        native.qmm(torch.zeros(1, 40), w, "Q8_0", 4, 40)
    with pytest.raises(RuntimeError, match="weights hold 136 bytes"):
        native.qmm(torch.zeros(1, 64), w, "Q8_0", 4, 64)


def test_disabled_native_kernels_are_said_once_and_torch_runs(tmp_path):
    code = "from weightstream.engine import native; print(native.available(), native.available(), native.best_path())"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "WEIGHTSTREAM_NATIVE": "0"},
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.split() == ["False", "False", "portable"], r.stderr
    assert r.stderr.count("native kernels off") == 1 and "WEIGHTSTREAM_NATIVE=0" in r.stderr


@pytest.mark.parametrize("wtypes", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q4_1", "Q4_0")])
def test_one_call_expert_ffn_is_the_composed_product(wtypes):
    """expert_ffn = (silu(x G^T) * x U^T) D^T * w in one call: close to the same steps through qmm and torch
    (the steps round between them, the fused op keeps float32), bitwise alone or batched, 1 or 2 threads."""
    gu_type, down_type = wtypes
    hidden, inter, rows = 512, 256, 5
    gate_up = torch.from_numpy(_blocks(gu_type, 2 * inter, hidden, seed=6)).reshape(-1)
    down = torch.from_numpy(_blocks(down_type, hidden, inter, seed=7)).reshape(-1)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(8))
    w = torch.rand(rows, 1, generator=torch.Generator().manual_seed(9))
    fused = native.expert_ffn(x, gate_up, gu_type, down, down_type, w)
    gu = native.qmm(x, gate_up, gu_type, 2 * inter, hidden)
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    composed = native.qmm(h, down, down_type, hidden, inter) * w
    assert fused.dtype == x.dtype
    assert float((fused - composed).abs().max() / composed.abs().max()) < 1e-5  # the same arithmetic, reordered
    assert torch.equal(native.expert_ffn(x[3:4], gate_up, gu_type, down, down_type, w[3:4]), fused[3:4])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.expert_ffn(x, gate_up, gu_type, down, down_type, w), fused)
    finally:
        torch.set_num_threads(threads)
