"""The float32 steps between products as native ops (csrc/layers.cpp, engine/fused.py): each against transformers'
own code, and a quantized-dense model with them against the same model without."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
from transformers.models.qwen3_moe import modeling_qwen3_moe

from weightstream import native
from weightstream.engine.fused import NORM_TOLERANCE, NativeRMSNorm, NativeRotary, _norm_proves, _rope_proves
from weightstream.store.presets import TINY
from weightstream.store.quant.pipeline import quantize_checkpoint

from engine_support import greedy_run

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])


@pytest.fixture(autouse=True)
def _native_built():
    assert native.available(), native.why_not()


def _standard_rope(q, k, cos, sin):
    """transformers' rotary embedding, whatever a modeling module has put in its place."""
    original = modeling_qwen3_moe.apply_rotary_pos_emb
    return getattr(original, "original", original)(q, k, cos, sin)


@pytest.mark.parametrize(
    "batch,heads,kv_heads,seq,dim,cos_batch",
    [(1, 16, 16, 1, 128, 1), (1, 8, 2, 7, 64, 1), (3, 4, 4, 5, 32, 3), (2, 2, 1, 9, 16, 1)],
)
def test_rope_is_bitwise_the_standard_rotary_embedding(batch, heads, kv_heads, seq, dim, cos_batch):
    """q and k as attention passes them (viewed (B, S, H, D), transposed), GQA, batch-1 cos: same bits, same
    layout (strides of the dimensions longer than 1)."""
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(batch, seq, heads, dim, generator=gen).mul_(3).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(2, cos_batch, seq, dim, generator=gen)
    want = _standard_rope(q, k, cos, sin)
    got = native.rope(q, k, cos, sin)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
        assert _layout(w) == _layout(g)


def _layout(t: torch.Tensor) -> list[int]:
    return [stride for stride, n in zip(t.stride(), t.shape, strict=True) if n > 1]


def test_rms_norm_is_transformers_to_the_rounding_of_its_scale():
    """Rows from 1e-4 to 1e4 in size, a width that is not a multiple of 8: within NORM_TOLERANCE of the module's
    output (the squares are summed in another order), and row by row the same whatever the rows around it."""
    gen = torch.Generator().manual_seed(0)
    for width in (2048, 100):
        norm = OlmoeRMSNorm(width, eps=1e-6)
        norm.weight.data = torch.randn(width, generator=gen)
        rows = torch.randn(2, 3, width, generator=gen) * torch.logspace(-4, 4, 3).view(1, 3, 1)
        with torch.no_grad():
            want, got = norm(rows), native.rms_norm(rows, norm.weight, norm.variance_epsilon)
        assert got.shape == want.shape
        err = (want - got).abs() / want.abs().amax(dim=-1, keepdim=True)
        assert float(err.max()) <= NORM_TOLERANCE
        assert torch.equal(native.rms_norm(rows[1, 2:], norm.weight, 1e-6), got[1, 2:])


def test_linear_is_the_product_in_the_inputs_dtype_plus_bias():
    """One call for NativeLinear's decode step: (..., K) in, (..., N) out in x's dtype, bias added after."""
    weights = (np.random.default_rng(0).standard_normal((48, 64)) * 0.05).astype(np.float32)
    w = torch.from_numpy(quants.quantize(weights, GGMLQuantizationType.Q8_0)).reshape(-1)
    bias = torch.randn(48)
    x = torch.randn(2, 3, 64)
    got = native.linear(x, w, "Q8_0", 48, 64, bias)
    want = native.qmm(x.reshape(-1, 64), w, "Q8_0", 48, 64).reshape(2, 3, 48) + bias
    assert torch.equal(got, want)
    x, bias = x.bfloat16(), bias.bfloat16()
    half = native.linear(x, w, "Q8_0", 48, 64, bias)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, native.qmm(x.reshape(-1, 64), w, "Q8_0", 48, 64).bfloat16().reshape(2, 3, 48) + bias)


def test_forms_that_are_not_the_standard_ones_are_not_proven():
    """Gemma's (1 + weight) norm and a rotary embedding that rotates interleaved pairs stay as they are."""

    class GemmaLikeRMSNorm(OlmoeRMSNorm):
        def forward(self, x):
            variance = x.pow(2).mean(-1, keepdim=True)
            return (1 + self.weight) * (x * torch.rsqrt(variance + self.variance_epsilon))

    norm = GemmaLikeRMSNorm(64)
    norm.weight.data = torch.randn(64)
    assert not _norm_proves(norm, norm.variance_epsilon)
    plain = OlmoeRMSNorm(64)
    plain.weight.data = torch.randn(64)
    assert _norm_proves(plain, plain.variance_epsilon)

    def interleaved(q, k, cos, sin):
        def turn(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    assert not _rope_proves(interleaved)
    assert _rope_proves(getattr(modeling_qwen3_moe.apply_rotary_pos_emb, "original", None) or _standard_rope)


@pytest.mark.parametrize("batch,heads,seq,dim", [(1, 16, 1, 64), (1, 128, 3, 64), (2, 4, 5, 16)])
def test_the_interleaved_rope_is_bitwise_deepseek_v3s(batch, heads, seq, dim):
    """DeepSeek-V3's interleaved rotary (pairs of even and odd elements, the first half of cos and sin) against the
    native op's interleaved form: same bits for q (B, H, S, D) transposed and the one-head rotary key; each proof
    tells the two forms apart."""
    original = modeling_deepseek_v3.apply_rotary_pos_emb_interleave
    original = getattr(original, "original", original)
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(batch, seq, heads, dim, generator=gen).mul_(3).transpose(1, 2)
    k = torch.randn(batch, 1, seq, dim, generator=gen)
    cos, sin = torch.randn(2, batch, seq, dim, generator=gen)
    for want, got in zip(original(q, k, cos, sin), native.rope(q, k, cos, sin, True), strict=True):
        assert want.shape == got.shape and torch.equal(want, got)
    assert not torch.equal(native.rope(q, k, cos, sin)[0], native.rope(q, k, cos, sin, True)[0])
    assert _rope_proves(original, True) and not _rope_proves(original, False)
    assert not _rope_proves(_standard_rope, True)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_a_quantized_dense_model_runs_fused_and_answers_as_unfused(tiny_model, tmp_path, arch):
    """Every tiny architecture with int8 dense weights: its norms and rotary run natively where they prove,
    streamed equals resident bitwise with them, and the logits stay within float32 noise of transformers' ops."""
    out = str(tmp_path / arch)
    quantize_checkpoint(tiny_model(arch, "bf16"), out, 8, dense="int8")
    tokens, logits, runtime = greedy_run(out, PROMPT, expert_cache="100x", io_threads=2)
    assert any(f.endswith("RMSNorm") for f in runtime.fused), runtime.fused  # every one is Llama-style
    # DeepSeek V2 rotates complex pairs, gpt-oss halves without rotate_half: theirs stay
    rotary = any(f.endswith(".apply_rotary_pos_emb") for f in runtime.fused)
    assert rotary == (arch not in ("deepseek_v2", "gpt_oss")), runtime.fused
    interleaved = "modeling_deepseek_v3.apply_rotary_pos_emb_interleave" in runtime.fused  # V3's own form
    assert interleaved == (arch == "deepseek_v3"), runtime.fused
    streamed_tokens, streamed, _ = greedy_run(out, PROMPT, expert_cache="1x", io_threads=3)
    assert streamed_tokens == tokens and all(torch.equal(s, w) for s, w in zip(streamed, logits, strict=True))
    plain_tokens, plain, plain_runtime = greedy_run(out, PROMPT, expert_cache="100x", fuse=False)
    assert plain_runtime.fused == []
    first, ref = logits[0].float(), plain[0].float()
    assert float((first - ref).abs().max() / ref.abs().max()) < 1e-4  # measured 0 to 2e-7


def test_the_rotary_replacement_falls_back_for_what_it_does_not_cover():
    """bf16 tensors, an unsqueeze_dim: the original function runs."""
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    rotary = NativeRotary(original)
    q = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 3, 8)
    rotary(q.bfloat16(), q.bfloat16(), cos.bfloat16(), cos.bfloat16())
    rotary(q, q, cos, cos, unsqueeze_dim=2)
    assert calls == [1, 2]
    assert torch.equal(rotary(q, q, cos, cos)[0], native.rope(q, q, cos, cos)[0]) and len(calls) == 2


def test_a_fused_norm_keeps_one_weight_and_runs_the_module_for_other_dtypes():
    norm = OlmoeRMSNorm(16)
    norm.weight.data = torch.randn(16)
    fused = NativeRMSNorm(norm, norm.variance_epsilon)
    assert [n for n, _ in fused.named_parameters()] == ["weight"]
    x = torch.randn(2, 16).bfloat16()
    assert torch.equal(fused(x), norm(x))
