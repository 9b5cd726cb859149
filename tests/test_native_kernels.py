"""The native kernels (csrc/qmm.cpp) against independent references: GGML's block formats as the `gguf` package
decodes them, float products, each other (AVX2 against portable, bitwise), and thread counts."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from weightstream import native
from weightstream.store.quant.ggml_blocks import ENCODERS

TYPES = list(native.BLOCK_TYPES)
# where a K type keeps its fp16 super-block scales (d, and dmin where it has one): byte offsets in the block
FP16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(wtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random rows of blocks: encoded from Gaussian weights where gguf can encode the type, else random bytes
    with sane fp16 scales (every code and scale pattern the decoder must read)."""
    rng = np.random.default_rng(seed)
    kind = getattr(GGMLQuantizationType, wtype)
    if wtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):
        return quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), kind)
    block, size = quants.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    if wtype == "MXFP4":  # exponents around 2^0, both sides, every code
        raw[..., 0] = rng.integers(118, 134, size=(n, k // block), dtype=np.uint8)
        return raw.reshape(n, -1)
    for at in FP16_SCALES[wtype]:
        raw[..., at : at + 2] = rng.uniform(1e-4, 1e-2, size=(n, k // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


WITHOUT_THE_EXTENSION = {
    "test_the_build_made_the_extension",
    "test_disabled_native_kernels_are_said_once_and_torch_runs",
}


@pytest.fixture(autouse=True)
def _needs_the_extension(request):
    """Where the kernels are off, their tests skip naming the cause; test_the_build_made_the_extension fails where
    the machine could have built them and did not."""
    if request.node.originalname not in WITHOUT_THE_EXTENSION and not native.available():
        pytest.skip(f"the native kernels are off: {native.why_not()}")


def test_the_extensions_block_table_is_the_packages():
    """csrc/qmm.cpp's WS_TYPES and native.BLOCK_TYPES are one table: each type's GGML id and sizes as the gguf
    package has them, and an extension whose table differs is not used (it was built from other sources)."""
    for name, t in native.BLOCK_TYPES.items():
        kind = getattr(GGMLQuantizationType, name)
        block, size = quants.GGML_QUANT_SIZES[kind]
        assert t.id == int(kind) and t.bytes * block == size * t.elements, name
        assert (t.elements, t.bytes) == (block, size) or name == "BF16", name  # BF16: rows of 32 values
    code = (
        "from weightstream import native; native.BLOCK_TYPES = dict(native.BLOCK_TYPES); "
        "native.BLOCK_TYPES['Q4_K'] = native.BlockType(256, 145, 12, 256); print(native.available())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr
    assert "built from other sources" in r.stderr and "pip install --no-build-isolation" in r.stderr


def test_the_build_made_the_extension():
    """`make test` builds the extension (pip, --no-build-isolation) wherever a C++ compiler is; every test here
    needs it, and skips saying why where it is off."""
    if os.environ.get("WEIGHTSTREAM_NATIVE") == "0":
        pytest.skip("WEIGHTSTREAM_NATIVE=0: the native kernels are turned off")
    if not native.available() and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip(f"no C++ compiler on this machine to build the extension: {native.why_not()}")
    assert native.available(), native.why_not()


@pytest.mark.parametrize("wtype", TYPES)
def test_dequantize_is_bitwise_ggufs_reference(wtype):
    n, k = 48, 512
    raw = _blocks(wtype, n, k)
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, wtype)).reshape(n, k)
    got = native.dequantize(torch.from_numpy(raw).reshape(-1), wtype, n, k)
    assert np.array_equal(got.numpy(), want)


def _product_case(wtype: str):
    n, k = 72, 768 if native.BLOCK_TYPES[wtype].elements == 32 else 512
    w = torch.from_numpy(_blocks(wtype, n, k, seed=1)).reshape(-1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    return x, w, n, k


def _needs_avx2():
    if native.best_path() != "avx2":
        pytest.skip("this CPU runs only the portable path: nothing to compare it with")


@pytest.mark.parametrize("wtype", TYPES)
def test_products_are_close_to_float(wtype):
    x, w, n, k = _product_case(wtype)
    portable = native.qmm(x, w, wtype, n, k, "portable")
    exact = x.double() @ native.dequantize(w, wtype, n, k).double().t()
    # 8-bit activations: each block's error is at most half a step of 127 per value; BF16 keeps float32 activations,
    # so only float32 rounding is left
    error = float((portable.double() - exact).abs().max() / exact.abs().max())
    assert error < (1e-5 if wtype == "BF16" else 0.02), error


@pytest.mark.parametrize("path", ["avx2", "avx2-rows"])
@pytest.mark.parametrize("wtype", TYPES)
def test_products_avx2_equal_portable_bitwise(wtype, path):
    """Both row paths: "avx2" (on a CPU with AVX-512 VNNI, the K types' body built for it and the 32-element types'
    own kernel) and "avx2-rows" (AVX2's body alone, as a CPU without AVX-512 runs it)."""
    _needs_avx2()
    x, w, n, k = _product_case(wtype)
    assert torch.equal(native.qmm(x, w, wtype, n, k, path), native.qmm(x, w, wtype, n, k, "portable"))


@pytest.mark.parametrize("wtype", [t for t in TYPES if native.BLOCK_TYPES[t].elements == 32 and t != "BF16"])
def test_rows_whose_last_group_of_blocks_is_partial_equal_portable_bitwise(wtype):
    """The row path ("avx2": on a CPU with AVX-512 VNNI the 32-element types take their own kernel) handles blocks
    eight at a time; a row of 1, 4 (DeepSeek's k_b rows of 128), 7 or 25 blocks ends inside a group, whose lanes past
    the row must keep their value. Those lanes read the next row's activation scales: here the next row holds an
    infinity (its scale infinite), which any lane not discarded would carry into the result as NaN."""
    _needs_avx2()
    for blocks in (1, 4, 7, 25):
        n, k = 40, 32 * blocks
        w = torch.from_numpy(_blocks(wtype, n, k, seed=blocks)).reshape(-1)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(blocks))
        x[1, 0] = float("inf")  # row 0 reads row 1's scales past its end
        x[2] = -x[2].abs()
        want = native.qmm(x, w, wtype, n, k, "portable")
        for path in ("avx2", "avx2-rows"):
            got = native.qmm(x, w, wtype, n, k, path)
            assert torch.isfinite(got[[0, 2]]).all() and torch.equal(got[[0, 2]], want[[0, 2]]), (blocks, path)


def _tile_paths():
    """The tile kernels this CPU runs: AVX2's (8 rows a vector) and, with AVX-512 VNNI, VNNI's (16)."""
    if not native.tiles_available():
        pytest.skip("this CPU has no AVX2: the multi-row tiles do not run here")
    return ["avx2-tiles"] + (["avx512"] if native.vnni_available() else [])


@pytest.mark.parametrize("wtype", [t for t in TYPES if t != "BF16"])
def test_tiles_equal_portable_bitwise_at_every_row_count(wtype):
    """The multi-row tiles (16 rows a vector, or 8 for a last tile of 8 rows or fewer; every code and scale pattern
    of random blocks) give the portable rows' bits: one row (7 lanes empty), a few, a whole half tile, one row past
    it (7 lanes of 16 empty), a whole tile, a tile and a part on either side of 8; and auto, which switches from
    rows to tiles at `native.tile_rows(wtype)` rows, gives them too. Both kernels where the CPU has them: AVX2's
    (8-bit products in int16 pairs, as many added in int16 as the type's largest code allows; Q8_0's codes taken as
    signed) and VNNI's."""
    paths = _tile_paths()
    _, w, n, k = _product_case(wtype)
    for rows in (1, 3, 4, 5, 8, 9, 16, 21, 24, 25):
        x = (
            torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            * torch.linspace(0.01, 30, rows)[:, None]
        )
        portable = native.qmm(x, w, wtype, n, k, "portable")
        for path in paths:
            assert torch.equal(native.qmm(x, w, wtype, n, k, path), portable), (path, rows)
        assert torch.equal(native.qmm(x, w, wtype, n, k), portable), rows


@pytest.mark.parametrize("wtypes", [("Q4_K", "Q6_K"), ("Q8_0", "Q5_0"), ("Q5_K", "MXFP4")])
def test_a_moe_layer_by_tiles_equals_it_by_rows_and_token_by_token(wtypes):
    """40 tokens over 6 experts: about 20 rows an expert, so auto computes every projection as tiles; the same bits
    as the portable rows, and as each token alone (one row an expert: rows)."""
    paths = _tile_paths()
    gu_type, down_type = wtypes
    x, index, weights, gate_up, down, _, _ = _moe_layer_case(gu_type, down_type, tokens=40)
    experts = sorted(set(index.reshape(-1).tolist()))
    args = (experts, [gate_up[e] for e in experts], gu_type, [down[e] for e in experts], down_type)
    tiles = native.moe_layer(x, index, weights, *args)
    assert torch.equal(native.moe_layer(x, index, weights, *args, path="portable"), tiles)
    for path in paths:
        assert torch.equal(native.moe_layer(x, index, weights, *args, path=path), tiles), path
    for t in (0, 17, 39):
        assert torch.equal(
            native.moe_layer(x[t : t + 1], index[t : t + 1], weights[t : t + 1], *args), tiles[t : t + 1]
        )


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_K", "Q2_K"])
def test_activations_are_quantized_alike_on_both_paths_ties_and_zeros_included(wtype):
    """The AVX2 quantizer against the portable one, through the products: a block whose largest value is 127 (its
    scale 1, so x.5 values round half to even), an all-zero block, a block led by a negative value, tiny values."""
    _needs_avx2()
    k = 512
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    x[0, :32] = torch.arange(32) - 15.5  # halves, then 127 sets the scale to 1
    x[0, 31] = 127.0
    x[0, 256:288] = 0.0
    x[1, :256] *= 1e-30
    x[2, 7] = -50.0
    w = torch.from_numpy(_blocks(wtype, 16, k, seed=3)).reshape(-1)
    assert torch.equal(native.qmm(x, w, wtype, 16, k, "avx2"), native.qmm(x, w, wtype, 16, k, "portable"))


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_K", "BF16"])
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
    bound = {
        "Q8_0": 0.01,
        "Q4_0": 0.1,
        "Q4_1": 0.1,
        "Q5_0": 0.05,
        "Q5_1": 0.05,
        "Q2_K": 0.4,
        "Q3_K": 0.2,
        "Q4_K": 0.1,
        "Q5_K": 0.05,
        "Q6_K": 0.03,
    }
    assert rms < {**bound, "MXFP4": 0.15, "BF16": 0.003}[wtype], rms
    assert np.array_equal(native.dequantize(raw.reshape(-1), wtype, 32, 512).numpy(), back)


def test_bad_shapes_are_refused_not_read_past():
    w = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not whole blocks of 32"):
        native.qmm(torch.zeros(1, 40), w, "Q8_0", 4, 40)
    with pytest.raises(RuntimeError, match="weights hold 136 bytes"):
        native.qmm(torch.zeros(1, 64), w, "Q8_0", 4, 64)


def test_disabled_native_kernels_are_said_once_and_torch_runs(tmp_path):
    code = "from weightstream import native; print(native.available(), native.available(), native.best_path())"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "WEIGHTSTREAM_NATIVE": "0"},
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.split() == ["False", "False", "portable"], r.stderr
    assert r.stderr.count("native kernels off") == 1 and "WEIGHTSTREAM_NATIVE=0" in r.stderr


def _moe_layer_case(gu_type: str, down_type: str, tokens: int, seed: int = 6):
    """A layer of 6 experts (blocks per expert), a batch of tokens routed top-3 without repeats, bf16 states."""
    hidden, inter, n_experts, top_k = 512, 256, 6, 3
    gen = torch.Generator().manual_seed(seed)
    gate_up = [torch.from_numpy(_blocks(gu_type, 2 * inter, hidden, seed=seed + e)) for e in range(n_experts)]
    down = [torch.from_numpy(_blocks(down_type, hidden, inter, seed=seed + 50 + e)) for e in range(n_experts)]
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return x, index, weights, gate_up, down, hidden, inter


WTYPE_PAIRS = [
    ("Q4_K", "Q6_K"),
    ("Q8_0", "Q8_0"),
    ("Q4_1", "Q4_0"),
    ("BF16", "BF16"),
    ("Q2_K", "Q3_K"),
    ("Q5_K", "MXFP4"),
]


@pytest.mark.parametrize("wtypes", WTYPE_PAIRS)
def test_one_call_moe_layer_is_the_sum_of_its_experts(wtypes):
    """moe_layer = per token, the sum over its routed experts of (silu(x G^T) * x U^T) D^T * w, in one call:
    close to the same steps through qmm and torch (they round between steps, the op keeps float32); a token's
    output does not depend on the other tokens; any thread count, and so either schedule, gives the same bits."""
    gu_type, down_type = wtypes
    x, index, weights, gate_up, down, hidden, inter = _moe_layer_case(gu_type, down_type, tokens=4)
    experts = sorted(set(index.reshape(-1).tolist()))
    got = native.moe_layer(
        x, index, weights, experts, [gate_up[e] for e in experts], gu_type, [down[e] for e in experts], down_type
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    want = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for c in sorted(range(index.shape[1]), key=lambda c: int(index[t, c])):
            e = int(index[t, c])
            gu = native.qmm(x[t : t + 1], gate_up[e].reshape(-1), gu_type, 2 * inter, hidden)
            h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            want[t] += (native.qmm(h, down[e].reshape(-1), down_type, hidden, inter) * weights[t, c])[0]
    assert float((got.float() - want).abs().max() / want.abs().max()) < 1e-2  # bf16 output rounding
    one = native.moe_layer(
        x[2:3],
        index[2:3],
        weights[2:3],
        experts,
        [gate_up[e] for e in experts],
        gu_type,
        [down[e] for e in experts],
        down_type,
    )
    assert torch.equal(one, got[2:3])
    threads = torch.get_num_threads()
    try:
        # 1 thread: whole experts per task; 16 threads for these 6 experts: each projection split across threads
        for n in (1, 16):
            torch.set_num_threads(n)
            again = native.moe_layer(
                x,
                index,
                weights,
                experts,
                [gate_up[e] for e in experts],
                gu_type,
                [down[e] for e in experts],
                down_type,
            )
            assert torch.equal(again, got), n
    finally:
        torch.set_num_threads(threads)


def test_gpt_oss_gate_and_biases_in_one_call_match_its_steps():
    """gate="clamped-swiglu" with biases (gpt-oss's experts): gate/up rows interleaved, the gate clamped above,
    up clamped both ways, (u + 1) * g * sigmoid(alpha g), biases after each product: close to the same steps through
    qmm and transformers' own gate function; every clamp is reached; grouping and threads give the same bits."""
    x, index, weights, gate_up, down, hidden, inter = _moe_layer_case("MXFP4", "MXFP4", tokens=4)
    x = (x.float() * 8).to(torch.bfloat16)  # products past the clamp limit, so both clamps act
    alpha, limit = 1.702, 7.0
    gen = torch.Generator().manual_seed(3)
    gu_bias = [torch.randn(2 * inter, generator=gen).to(torch.bfloat16) for _ in gate_up]
    d_bias = [torch.randn(hidden, generator=gen).to(torch.bfloat16) for _ in down]
    experts = sorted(set(index.reshape(-1).tolist()))
    args = dict(
        gate_up=[gate_up[e] for e in experts],
        gate_up_type="MXFP4",
        down=[down[e] for e in experts],
        down_type="MXFP4",
        gate_up_bias=[gu_bias[e] for e in experts],
        down_bias=[d_bias[e] for e in experts],
        gate="clamped-swiglu",
        alpha=alpha,
        limit=limit,
    )
    got = native.moe_layer(x, index, weights, experts, **args)
    want, clamped = torch.zeros(x.shape, dtype=torch.float32), [0, 0, 0]
    for t in range(x.shape[0]):
        for c in sorted(range(index.shape[1]), key=lambda c: int(index[t, c])):
            e = int(index[t, c])
            gu = native.qmm(x[t : t + 1], gate_up[e].reshape(-1), "MXFP4", 2 * inter, hidden) + gu_bias[e].float()
            g, u = gu[:, ::2], gu[:, 1::2]
            clamped = [
                clamped[0] + int((g > limit).sum()),
                clamped[1] + int((u > limit).sum()),
                clamped[2] + int((u < -limit).sum()),
            ]
            h = (u.clamp(-limit, limit) + 1) * g.clamp(max=limit) * torch.sigmoid(alpha * g.clamp(max=limit))
            y = native.qmm(h, down[e].reshape(-1), "MXFP4", hidden, inter) + d_bias[e].float()
            want[t] += (y * weights[t, c])[0]
    assert min(clamped) > 0, clamped
    assert float((got.float() - want).abs().max() / want.abs().max()) < 1e-2  # bf16 output rounding
    contrib = torch.zeros(x.shape[0], index.shape[1], hidden)
    for group in (experts[::2], experts[1::2]):
        pick = [experts.index(e) for e in group]
        part = {k: [v[i] for i in pick] if isinstance(v, list) else v for k, v in args.items()}
        native.moe_layer(x, index, weights, group, **part, into=contrib)
    assert torch.equal(native.moe_sum(contrib, index, x), got)
    threads = torch.get_num_threads()
    try:
        for n in (1, 16):
            torch.set_num_threads(n)
            assert torch.equal(native.moe_layer(x, index, weights, experts, **args), got), n
    finally:
        torch.set_num_threads(threads)


def test_a_moe_layer_refuses_biases_of_the_wrong_size():
    x, index, weights, gate_up, down, hidden, inter = _moe_layer_case("Q8_0", "Q8_0", tokens=2)
    experts = sorted(set(index.reshape(-1).tolist()))
    with pytest.raises(RuntimeError, match=f"gate_up bias must have {2 * inter} values"):
        native.moe_layer(
            x,
            index,
            weights,
            experts,
            [gate_up[e] for e in experts],
            "Q8_0",
            [down[e] for e in experts],
            "Q8_0",
            gate_up_bias=[torch.zeros(inter) for _ in experts],
            gate="clamped-swiglu",
            alpha=1.0,
            limit=7.0,
        )


def test_a_layer_computed_in_groups_equals_the_layer_in_one_call():
    """The cache's contract: resident experts first, each missing one when its bytes are in, in any order and any
    grouping; moe_layer(into=) per group and moe_sum give the single call's bits."""
    x, index, weights, gate_up, down, _, _ = _moe_layer_case("Q4_K", "Q6_K", tokens=5)
    experts = sorted(set(index.reshape(-1).tolist()))
    whole = native.moe_layer(
        x, index, weights, experts, [gate_up[e] for e in experts], "Q4_K", [down[e] for e in experts], "Q6_K"
    )

    def contribute(contrib, group):
        native.moe_layer(
            x,
            index,
            weights,
            group,
            [gate_up[e] for e in group],
            "Q4_K",
            [down[e] for e in group],
            "Q6_K",
            into=contrib,
        )

    for groups in ([experts[3:], experts[:1], experts[1:3]], [[e] for e in reversed(experts)]):
        contrib = torch.zeros(*index.shape, x.shape[1])
        for group in groups:
            contribute(contrib, group)
        assert torch.equal(native.moe_sum(contrib, index, x), whole)
    contrib = torch.zeros(*index.shape, x.shape[1])  # an expert left out: its rows stay zero, the sum differs
    contribute(contrib, experts[1:])
    assert not torch.equal(native.moe_sum(contrib, index, x), whole)
    # and the one call over the same experts leaves the same rows zero (it zeroes only what no given expert writes)
    part = native.moe_layer(
        x,
        index,
        weights,
        experts[1:],
        [gate_up[e] for e in experts[1:]],
        "Q4_K",
        [down[e] for e in experts[1:]],
        "Q6_K",
    )
    assert torch.equal(part, native.moe_sum(contrib, index, x))


def test_a_bf16_projection_takes_its_rows_below_its_switch_and_the_dequantized_weight_from_it():
    """BF16 products stay native (each row its one-row product, bitwise) below BF16_DEQUANT_ROWS and are F.linear
    on the dequantized weight from it; integer block types keep their own switch (every row count native with the
    tiles, else NATIVE_DEQUANT_ROWS)."""
    from weightstream.engine.kernels.quantized import (
        BF16_DEQUANT_ROWS,
        NATIVE_DEQUANT_ROWS,
        native_dequant_rows,
        native_product,
    )

    n, k = 64, 256
    w = torch.from_numpy(_blocks("BF16", n, k, seed=8)).reshape(n, -1)
    switch = native_dequant_rows(["BF16"])
    assert switch == BF16_DEQUANT_ROWS > NATIVE_DEQUANT_ROWS
    assert native_dequant_rows(["Q4_K"]) == (float("inf") if native.tiles_available() else NATIVE_DEQUANT_ROWS)
    dense = native.dequantize(w.reshape(-1), "BF16", n, k)
    for rows in (switch - 1, switch):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = native_product(x, w, "BF16", n, k, switch)
        by_row = torch.cat([native.qmm(x[r : r + 1], w.reshape(-1), "BF16", n, k) for r in range(rows)])
        dequantized = torch.nn.functional.linear(x, dense)
        assert not torch.equal(by_row, dequantized)  # the routes differ in their last bits: the test tells them apart
        assert torch.equal(got, by_row if rows < switch else dequantized)


# Where a block type keeps its float16 scales (d, and dmin where it has one): the rest of a worst-case block is
# 0xff, every code at its largest (Q8_0: 0x7f or 0x80, its largest and smallest signed codes).
_SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}


@pytest.mark.parametrize(
    "wtype, fill", [("Q4_K", 0xFF), ("Q5_K", 0xFF), ("Q6_K", 0xFF), ("Q8_0", 0x7F), ("Q8_0", 0x80)]
)
def test_tiles_are_exact_at_the_largest_codes_and_activations(wtype, fill):
    """AVX2's tiles add vpmaddubsw's int16 pair sums in int16, as many as the type's largest code allows before
    they could saturate (Q6_K two, Q5_K four, Q4_K eight): every code at its largest against activations all at
    +-127 is the sum closest to the limit, and must still give the portable rows' bits."""
    paths = _tile_paths()
    n, k = 8, 512
    t = native.BLOCK_TYPES[wtype]
    block = np.full(t.bytes, fill, dtype=np.uint8)
    for at in _SCALE_AT[wtype]:
        block[at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    w = torch.from_numpy(np.tile(block, n * k // t.elements))
    x = torch.ones(6, k) * torch.tensor([1.0, -1.0, 3.0, -3.0, 1.0, -1.0])[:, None]
    portable = native.qmm(x, w, wtype, n, k, "portable")
    assert torch.isfinite(portable).all()
    for path in paths:
        assert torch.equal(native.qmm(x, w, wtype, n, k, path), portable), path
