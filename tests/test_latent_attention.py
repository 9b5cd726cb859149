"""DeepSeek's latent attention absorbed (engine/latent_attention.py): the same attention as transformers' expanded
form within rounding, bitwise the same streamed or resident, and the expanded form still bitwise transformers'."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from weightstream import native
from weightstream.engine.generate import generate
from weightstream.engine.latent_attention import LatentAttention, absorb_latent_attention, rows_to_expand
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.facts import kv_cache_bytes

from engine_support import greedy_run

ARCHS = ("deepseek_v2", "deepseek_v3")
WIDE = dict(qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64)  # k_b and v_b rows of whole bf16 blocks
PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
# relative to the logits' largest magnitude: float32 sums in another order (measured 2.2e-7); bf16 model outputs
# one rounding of the final norm and head apart (measured 5.7e-3: one bf16 ulp of the largest logit)
TOLERANCE = {"fp32": 2e-6, "bf16": 1.6e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _reference(model_dir: str, dtype: str, prompt: torch.Tensor, new: int):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], experts_implementation="eager")
    with torch.inference_mode():
        out = ref.generate(
            prompt, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences[0].tolist(), list(out.logits)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", [*ARCHS, "deepseek_v3-wide"])
def test_absorbed_logits_within_tolerance_of_transformers(tiny_model, arch, dtype):
    """Each step's logits, the engine fed transformers' own tokens, are within TOLERANCE of transformers' (the
    wide bf16 model: k_b and v_b as bf16 rows through the native per-head products)."""
    name, _, wide = arch.partition("-")
    model_dir = tiny_model(name, dtype, **(WIDE if wide else {}))
    tokens, want = _reference(model_dir, dtype, PROMPT, 12)
    model = load_streaming_model(model_dir, expert_cache="100x")
    try:
        assert model.weightstream.latent_attention == "absorbed"
        latents = [m._ws_latent for m in model.modules() if hasattr(m, "_ws_latent")]
        assert latents and all((x.k_rows is not None) == (bool(wide) and dtype == "bf16") for x in latents)
        ids = torch.tensor([tokens])
        with torch.inference_mode():  # one step at a time on transformers' sequence: no divergence compounds
            cache = None
            for step in range(len(want)):
                upto = PROMPT.shape[1] + step
                chunk = ids[:, :upto] if cache is None else ids[:, upto - 1 : upto]
                out = model(chunk, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                assert _relative(out.logits[:, -1], want[step]) <= TOLERANCE[dtype], (arch, dtype, step)
    finally:
        model.weightstream.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_absorbed_streamed_equals_resident_bitwise(tiny_model, arch):
    """The absorbed form at every cache size and I/O thread count gives the tokens and logits of every expert
    resident, bitwise."""
    model_dir = tiny_model(arch)
    want_tokens, want_logits, _ = greedy_run(model_dir, PROMPT, 10, expert_cache="100x")
    for size in ("1x", "1.5x"):
        for threads in (1, 8):
            tokens, logits, runtime = greedy_run(model_dir, PROMPT, 10, expert_cache=size, io_threads=threads)
            assert runtime.cache.stats.misses > 0
            assert tokens == want_tokens, (size, threads)
            assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True)), (size, threads)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("deepseek_v3", {}),
        ("deepseek_v3", {"q_lora_rank": 24}),
        ("deepseek_v3", {"rope_interleave": False}),
        ("deepseek_v2", {}),  # V2's rotary: complex frequencies (8 dims: torch rounds them its other way here)
        ("deepseek_v2", {"q_lora_rank": 24, "qk_rope_head_dim": 16}),
        ("deepseek_v2", {"qk_rope_head_dim": 64}),  # V2-Lite's rotary size
    ],
)
def test_a_decode_step_skips_the_module_and_keeps_its_bits(tiny_model, arch, overrides, monkeypatch):
    """A float32 decode row runs LatentAttention.decode (V3 or V2; plain q or q_lora; each rotary form) and gives
    the module's forward's tokens and logits bitwise; the prompt runs the module."""
    model_dir = tiny_model(arch, **overrides)
    model = load_streaming_model(model_dir, expert_cache="100x")
    calls = []
    decode, rope_pairs, pairs = LatentAttention.decode, native.rope_pairs, []
    monkeypatch.setattr(LatentAttention, "decode", lambda self, *a: calls.append(1) or decode(self, *a))
    monkeypatch.setattr(native, "rope_pairs", lambda *a: pairs.append(1) or rope_pairs(*a))
    try:
        modules = [m for m in model.modules() if hasattr(m, "_ws_latent")]
        runs = []
        for lean in (True, False):
            if not lean:
                for module in modules:
                    del module.forward  # the class's forward again
            with torch.inference_mode():
                out = model.generate(
                    PROMPT, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
                )
            runs.append((out.sequences[0].tolist(), out.logits))
            if lean:
                assert len(calls) == 5 * len(modules)  # every step after the prompt's
                if arch == "deepseek_v2":  # its rotary natively where that gives transformers' bits
                    native_pairs = {m._ws_latent.native_pairs for m in modules}
                    proofs = 3 * len(modules)  # at most, at the first decode row
                    if native_pairs == {True}:
                        assert 5 * len(modules) < len(pairs) <= 5 * len(modules) + proofs
                    else:
                        assert native_pairs == {False} and len(pairs) <= proofs
        assert len(calls) == 5 * len(modules)
        (lean_tokens, lean_logits), (tokens, logits) = runs
        assert lean_tokens == tokens
        assert all(torch.equal(g, w) for g, w in zip(lean_logits, logits, strict=True))
    finally:
        model.weightstream.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_expanded_form_is_transformers_bitwise(tiny_model, arch):
    model_dir = tiny_model(arch)
    want_tokens, want_logits = _reference(model_dir, "fp32", PROMPT, 8)
    tokens, logits, runtime = greedy_run(model_dir, PROMPT, 8, expert_cache="1x", latent_attention="expanded")
    assert runtime.latent_attention == "expanded"
    assert tokens == want_tokens
    assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True))


def test_prompt_chunks_at_depth_match_one_prompt(tiny_model):
    """A prompt prefilled in chunks (queries of several rows over a longer cache, no mask from transformers) gives
    the logits of the whole prompt at once, within float32 rounding: the causal offset is the cache's."""
    model_dir = tiny_model("deepseek_v3")
    prompt = (torch.arange(60) * 37 + 11).remainder(500).add(5)[None, :]
    model = load_streaming_model(model_dir, expert_cache="100x")
    try:
        whole, _ = generate(model, prompt, max_new_tokens=6)
        chunked, _ = generate(model, prompt, max_new_tokens=6, prefill_chunk=7)
        assert torch.equal(whole, chunked)
    finally:
        model.weightstream.close()


def _module(heads=4, kv_lora=32, nope=16, rope=8, v=16, seed=0, bf16=False):
    """A stand-in with what LatentAttention reads of an MLA module: its sizes and kv_b_proj (float32, its values
    bfloat16 ones with `bf16`, as an imported GGUF's are)."""
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    module.num_heads, module.kv_lora_rank = heads, kv_lora
    module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim = nope, rope, v
    module.kv_b_proj = torch.nn.Linear(kv_lora, heads * (nope + v), bias=False)
    with torch.no_grad():
        weight = torch.randn(heads * (nope + v), kv_lora, generator=gen) * 0.2
        module.kv_b_proj.weight.copy_(weight.bfloat16().float() if bf16 else weight)
    return module, gen


@pytest.mark.parametrize("weights", ["float32", "bf16-rows"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("rows, positions", [(1, 1), (1, 37), (5, 5), (5, 40), (3, 64)])
def test_absorbed_equals_expanded_on_random_inputs(rows, positions, mask_kind, weights):
    """Both forms, the same queries, latents and masks (batch 2, the second row's first positions padded; no mask:
    causal from the cache's end): the same outputs within float32 rounding; k_b and v_b as float32 views (torch's
    products) or as bf16 rows (the native per-head products, where the weights are bf16 values and rows whole
    32-value blocks)."""
    rows_kept = weights == "bf16-rows" and native.available()
    if weights == "bf16-rows" and not rows_kept:
        pytest.skip("the native kernels are not built on this machine")
    nope, kv_lora = (32, 64) if rows_kept else (16, 32)
    module, gen = _module(kv_lora=kv_lora, nope=nope, v=nope, bf16=rows_kept)
    latent = LatentAttention(module)
    assert (latent.k_rows is not None) == rows_kept
    query = torch.randn(2, 4, rows, nope + 8, generator=gen)
    cached = torch.randn(2, 1, positions, kv_lora, generator=gen)
    k_rot = torch.randn(2, 1, positions, 8, generator=gen)
    causal = torch.ones(rows, positions, dtype=torch.bool).tril(positions - rows)
    mask = causal.expand(2, 1, rows, positions).clone()
    mask[1, :, :, : positions // 3] = False
    mask[1, :, :, positions - 1] = True  # every row attends somewhere
    given = mask
    if mask_kind == "none":  # causal from the cache's end (torch's is_causal would align it to the start)
        mask, given = causal.expand(2, 1, rows, positions), None
    elif mask_kind == "additive":
        mask = given = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    absorbed = latent._absorbed(query, cached, k_rot, given, 0.3)
    expanded = latent._expanded(query, cached, k_rot, mask, 0.3)
    assert absorbed.shape == expanded.shape == (2, rows, 4, nope)
    assert _relative(absorbed, expanded) <= 2e-6


def test_the_form_is_chosen_by_query_rows():
    """The expanded form from `rows_to_expand` query rows on: V2/V3's head sizes cross at 171."""
    assert rows_to_expand(512, 128, 128) == 171
    module, gen = _module()
    latent = LatentAttention(module)
    assert latent.expand_from == rows_to_expand(32, 16, 16) == 32
    cached, k_rot = torch.randn(1, 1, 40, 32, generator=gen), torch.randn(1, 1, 40, 8, generator=gen)
    for rows, form in ((31, "_absorbed"), (32, "_expanded")):
        query = torch.randn(1, 4, rows, 24, generator=gen)
        want = getattr(latent, form)(query, cached, k_rot, None, 0.3)
        assert torch.equal(latent.attend(query, cached, k_rot, None, 0.3), want)


def test_kv_cache_holds_the_latent_and_rotary_key(tiny_model):
    """What the cache holds after a generation is what store/facts.py states: (kv_lora + rope) x dtype a token and
    layer, the number --memory and tune reserve."""
    model_dir = tiny_model("deepseek_v3")
    model = load_streaming_model(model_dir, expert_cache="1x")
    try:
        cache = None
        with torch.inference_mode():
            out = model(PROMPT, use_cache=True)
            cache = out.past_key_values
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        text = model.config.get_text_config()
        assert held == kv_cache_bytes(text, PROMPT.shape[1], 4)
        assert held == PROMPT.shape[1] * text.num_hidden_layers * (32 + 8) * 4
        assert model.weightstream.kv_cache_bytes_per_token == text.num_hidden_layers * (32 + 8) * 4
    finally:
        model.weightstream.close()


def test_unknown_form_is_refused_before_loading(tiny_model):
    with pytest.raises(WeightstreamError, match="--latent-attention 'fast': choose one of absorbed, expanded"):
        load_streaming_model(tiny_model("deepseek_v3"), latent_attention="fast")
    with pytest.raises(WeightstreamError, match="choose one of"):
        absorb_latent_attention(torch.nn.Module(), "fast")


def test_other_families_are_left_alone(tiny_model):
    tokens, _, runtime = greedy_run(tiny_model("qwen3_moe"), PROMPT, 2, expert_cache="1x")
    assert runtime.latent_attention is None


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built on this machine")
@pytest.mark.parametrize(
    "batch, heads, kv_lora, rope, positions",
    [(1, 16, 512, 64, 300), (2, 3, 40, 8, 1), (1, 5, 33, 7, 129), (3, 4, 32, 8, 257)],
)
def test_one_pass_decode_equals_the_two_pass_form(batch, heads, kv_lora, rope, positions):
    """csrc/latent.cpp (one decode row, blocks of 128 positions, odd heads, widths off the 16-float vectors, strided
    cache rows) gives torch's scores-softmax-sum within float32 rounding."""
    gen = torch.Generator().manual_seed(positions)
    q_lat, q_rot = torch.randn(batch, heads, kv_lora, generator=gen), torch.randn(batch, heads, rope, generator=gen)
    c = torch.randn(batch, positions + 9, kv_lora, generator=gen)[:, :positions]  # a view, as the cache's
    r = torch.randn(batch, positions + 9, rope + 3, generator=gen)[:, :positions, 1 : rope + 1]
    scores = (q_lat @ c.transpose(1, 2) + q_rot @ r.transpose(1, 2)) * 0.11
    want = torch.softmax(scores, dim=-1) @ c
    got = native.latent_attend(q_lat, q_rot, c, r, 0.11)
    assert got.shape == want.shape
    assert _relative(got, want) <= 2e-6


def test_memory_reserves_what_a_late_forward_of_either_form_holds():
    """--memory's reserve for a forward late in the context (store/facts.py): the cache widened to float32, and a
    group of heads at a time (`latent_group`: as many as fit in 64 MiB): an absorbed chunk's float32 scores, or, past
    the crossover, the larger of a group's re-made keys and values with kv_b's float32 weight and a short chunk's
    scores (a prompt's last chunk); transformers' expanded form re-makes every head's at once."""
    from types import SimpleNamespace

    from weightstream.store.facts import GROUP_BYTES, context_temporaries, expand_group

    v2_lite = SimpleNamespace(
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_attention_heads=16
    )
    T = 16384
    widened, partial_sums = T * (512 + 64) * 4, 128 * 16 * 512 * 4
    scores = 3 * 32 * T * 4  # a head's, for a 32-row chunk: 10 heads fit in 64 MiB
    assert GROUP_BYTES // scores == 10
    absorbed = context_temporaries(v2_lite, T, 32, 4, eager=False)
    assert absorbed == widened + 10 * scores + partial_sums + 32 * T * 5
    # bf16 models too: the torch paths widen any stored cache to float32
    assert context_temporaries(v2_lite, T, 32, 2, eager=False) == absorbed
    per_head = T * (2 * 128 + 64 + 2 * 128) * 4 + 3 * 256 * T * 4
    assert expand_group(16, T, 256, 128, 64, 128, 4) == (1, per_head)
    short = 3 * 170 * T * 4  # a 170-row last chunk's scores, a head: 1 fits
    kv_b = 2 * 16 * 256 * 512 * 4
    late = context_temporaries(v2_lite, T, 256, 4, eager=False)
    assert late == widened + max(short + partial_sums, per_head + kv_b) + 256 * T * 5
    assert expand_group(16, 256, 256, 128, 64, 128, 4)[0] == 16  # a chunk early in the context: all heads at once
    expanded = T * (512 + 64) * 4 + 16 * T * (2 * 128 + 64 + 2 * 128) * 4
    assert context_temporaries(v2_lite, T, 32, 4, eager=False, latent="expanded") == expanded


@pytest.mark.parametrize("kv", ["auto", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_chunks_a_head_at_a_time_give_all_heads_at_once_logits(tiny_model, arch, kv, monkeypatch):
    """A prompt chunk's latent attention by torch runs a group of heads at a time (store/facts.py `latent_group`),
    absorbed (a chunk under the crossover) and expanded (past it), each under the mask of a chunk after the first:
    each head's scores, keys, values and attention are its own, so one head a group gives the logits of every head
    at once; with a q8_0 cache as well (its blocks widened for the expanded form)."""
    import weightstream.store.facts as facts
    from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg

    model = load_streaming_model(
        tiny_model(arch, **(Q8_SHAPE if kv == "q8_0" else {})), expert_cache="100x", kv_dtype=kv
    )
    prompt = torch.arange(60).remainder(300).add(3).reshape(1, -1)
    groups = []
    latent_group = facts.latent_group
    monkeypatch.setattr(facts, "latent_group", lambda *a: groups.append(latent_group(*a)[0]) or latent_group(*a))

    def logits() -> list[torch.Tensor]:  # 8 rows, then 12 (absorbed by torch), then 40 (expanded)
        cache, out = engine_cache(model, 60), []
        with torch.inference_mode(), quiet_cache_kwarg():
            for chunk in (prompt[:, :8], prompt[:, 8:20], prompt[:, 20:]):
                out.append(model(chunk, past_key_values=cache, use_cache=True).logits)
        return out

    try:
        assert 12 < model.model.layers[0].self_attn._ws_latent.expand_from <= 40
        whole = logits()
        assert groups and set(groups) == {model.config.num_attention_heads}
        groups.clear()
        monkeypatch.setattr(facts, "GROUP_BYTES", 1)  # one head a group
        each = logits()
        assert groups and set(groups) == {1}
    finally:
        model.weightstream.close()
    for got, want in zip(each, whole, strict=True):
        # bitwise here (2026-12-07); held to float32 rounding: a product over fewer rows may block differently
        assert _relative(got, want) <= TOLERANCE["fp32"], _relative(got, want)


def test_the_native_complex_pairs_rotation_rounds_each_product_then_the_sum():
    """native.rope_pairs against the same formula in separate torch ops (a c - b d, a d + b c: IEEE products and
    sums, whatever torch's complex multiplication does on this machine), on decode and prompt layouts."""
    assert native.available(), native.why_not()
    gen = torch.Generator().manual_seed(3)
    for heads, rows, dims in ((16, 1, 64), (4, 7, 8), (2, 3, 16)):
        query = torch.randn(1, rows, heads, 24 + dims, generator=gen).transpose(1, 2)[..., 24:]  # a slice of each head
        key = torch.randn(1, 1, rows, dims, generator=gen)
        freqs = torch.view_as_real(
            torch.polar(
                torch.rand(1, rows, dims // 2, generator=gen) + 0.5, torch.randn(1, rows, dims // 2, generator=gen)
            )
        )
        for t, got in zip((query, key), native.rope_pairs(query, key, freqs), strict=True):
            a, b, c, d = t[..., 0::2], t[..., 1::2], freqs[..., 0].unsqueeze(1), freqs[..., 1].unsqueeze(1)
            want = torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(3)
            assert got.shape == t.shape and torch.equal(got, want)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built on this machine")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, heads, kv_lora, rope, positions", [(1, 16, 512, 64, 300), (2, 3, 40, 8, 1), (1, 5, 33, 7, 129)]
)
def test_a_16bit_cache_is_attended_as_its_float32_values(dtype, batch, heads, kv_lora, rope, positions):
    """csrc/latent.cpp widens a float16 or bfloat16 cache (strided rows, widths off the vectors) a block at a time:
    the result is the float32 kernel's on the same values, bitwise."""
    gen = torch.Generator().manual_seed(positions)
    q_lat, q_rot = torch.randn(batch, heads, kv_lora, generator=gen), torch.randn(batch, heads, rope, generator=gen)
    rows = (torch.randn(batch, positions + 9, kv_lora + rope + 3, generator=gen) * 3).to(dtype)[:, :positions]
    c, r = rows[..., :kv_lora], rows[..., kv_lora + 1 : kv_lora + rope + 1]
    got = native.latent_attend(q_lat, q_rot, c, r, 0.11)
    assert got.dtype is torch.float32
    assert torch.equal(got, native.latent_attend(q_lat, q_rot, c.float(), r.float(), 0.11))
    with pytest.raises(RuntimeError, match="both float32, float16, bfloat16 or q8_0"):
        native.latent_attend(q_lat, q_rot, c, r.float(), 0.11)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built on this machine")
@pytest.mark.parametrize("batch, heads, kv_lora, rope, positions", [(1, 16, 512, 64, 300), (2, 3, 64, 32, 1)])
def test_a_q8_0_cache_holds_ggml_s_blocks_and_is_attended_as_their_values(batch, heads, kv_lora, rope, positions):
    """--kv-dtype q8_0: each row quantized as ggml quantizes q8_0 (byte for byte gguf-py's reference, the format
    llama.cpp's `-ctk q8_0` keeps), decoded exactly (d * q), and attended in one pass as the float32 kernel attends
    those values, bitwise (strided rows: a view of a wider buffer)."""
    import gguf

    from weightstream.engine.kv_cache import widened

    gen = torch.Generator().manual_seed(positions)
    q_lat, q_rot = torch.randn(batch, heads, kv_lora, generator=gen), torch.randn(batch, heads, rope, generator=gen)
    rows = torch.randn(batch, positions + 9, kv_lora + rope, generator=gen) * 3
    rows[0, 0, :32] = 0  # a block of zeros: scale 0, codes 0
    blocks = native.quantize_q8_0(rows)
    want = gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert blocks.dtype is torch.uint8 and np.array_equal(blocks.numpy(), want.reshape(blocks.shape))
    values = widened(blocks)
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(want, gguf.GGMLQuantizationType.Q8_0)))
    assert float((values - rows).abs().max()) <= float(rows.abs().max()) / 127  # half a step of the largest block
    c = native.quantize_q8_0(rows[..., :kv_lora])[:, :positions]
    r = native.quantize_q8_0(rows[..., kv_lora:])[:, :positions]
    got = native.latent_attend(q_lat, q_rot, c, r, 0.11)
    assert torch.equal(got, native.latent_attend(q_lat, q_rot, widened(c), widened(r), 0.11))
    with pytest.raises(RuntimeError, match="do not match"):
        native.latent_attend(q_lat, q_rot, c[..., :-1], r, 0.11)
    with pytest.raises(RuntimeError, match="whole blocks of 32 values"):
        native.quantize_q8_0(rows[..., :40])
    # a block holding a NaN or an infinity: a NaN scale and zero codes (decodes to NaNs); the next block as before
    bad = rows[0, :2, :64].clone()
    bad[0, 3], bad[1, 40] = float("nan"), float("inf")
    got = widened(native.quantize_q8_0(bad))
    assert got[0, :32].isnan().all() and got[1, 32:].isnan().all()
    assert torch.equal(got[0, 32:], widened(native.quantize_q8_0(rows[0, 0, 32:64])))
    assert torch.equal(got[1, :32], widened(native.quantize_q8_0(rows[0, 1, :32])))


def _decode_steps(model, prompt: torch.Tensor, steps: int, cache=None) -> tuple[list[int], list[torch.Tensor], object]:
    """Greedy tokens and each step's logits through the engine's cache (`engine_cache`, as `generate` runs)."""
    from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg

    cache = cache if cache is not None else engine_cache(model, prompt.shape[1] + steps)
    tokens, logits = [], []
    with torch.inference_mode(), quiet_cache_kwarg():
        chunk = prompt
        for _ in range(steps):
            out = model(chunk, past_key_values=cache, use_cache=True).logits[:, -1]
            chunk = out.argmax(-1, keepdim=True)
            tokens.append(int(chunk))
            logits.append(out)
    return tokens, logits, cache


# a tiny random model's logits with its latent cache rounded to 16 bits or q8_0, against the float32 cache's,
# relative to their largest magnitude (measured 2026-12-07 over 8 steps of V2 and V3: float16 at most 2.2e-4,
# bfloat16 1.6e-3, q8_0 5.1e-3; a trained model's perplexity in docs/benchmarks.md)
KV_TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3, "q8_0": 1.5e-2}
Q8_SHAPE = dict(qk_rope_head_dim=32, head_dim=32)  # q8_0 keeps whole 32-value blocks: the tiny preset's rope is 8
# bytes a cached token and layer: the tiny preset's kv_lora 32 and its rope (8, or 32 for q8_0's blocks)
KV_BYTES = {"float16": (32 + 8) * 2, "bfloat16": (32 + 8) * 2, "q8_0": (32 + 32) // 32 * 34}


@pytest.mark.parametrize("kv", sorted(KV_TOLERANCE))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_16bit_or_8bit_latent_cache(tiny_model, arch, kv):
    """--kv-dtype float16/bfloat16/q8_0: the cache holds half float32's bytes a token, or q8_0's 34 bytes a 32
    values (as stated to --memory and --json), streamed equals resident bitwise at every cache size and thread count,
    and the logits stay within KV_TOLERANCE of the float32 cache's, fed the same tokens."""
    model_dir = tiny_model(arch, **(Q8_SHAPE if kv == "q8_0" else {}))
    model = load_streaming_model(model_dir, expert_cache="100x")
    try:
        want_tokens, want_logits, _ = _decode_steps(model, PROMPT, 8)
    finally:
        model.weightstream.close()
    runs = []
    for size, threads in (("100x", 2), ("1x", 1), ("1.5x", 8)):
        model = load_streaming_model(model_dir, expert_cache=size, io_threads=threads, kv_dtype=kv)
        try:
            tokens, logits, cache = _decode_steps(model, PROMPT, 8)
            runs.append((tokens, logits))
            text = model.config.get_text_config()
            assert {layer.keys.dtype for layer in cache.layers} == {torch.uint8 if kv == "q8_0" else getattr(torch, kv)}
            per_token = text.num_hidden_layers * KV_BYTES[kv]
            assert model.weightstream.kv_cache_bytes_per_token == per_token
            held = sum(layer._key_buffer.nbytes + layer._value_buffer.nbytes for layer in cache.layers)
            assert held == per_token * (PROMPT.shape[1] + 8)
            if size != "100x":
                assert model.weightstream.cache.stats.misses > 0
        finally:
            model.weightstream.close()
    for tokens, logits in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(g, w) for g, w in zip(logits, runs[0][1], strict=True))
    # fed the float32 cache's tokens, step by step: no divergence compounds
    model = load_streaming_model(model_dir, expert_cache="100x", kv_dtype=kv)
    try:
        from weightstream.engine.kv_cache import engine_cache, quiet_cache_kwarg

        ids, cache = torch.tensor([PROMPT[0].tolist() + want_tokens]), engine_cache(model, 20)
        with torch.inference_mode(), quiet_cache_kwarg():
            for step, want in enumerate(want_logits):
                upto = PROMPT.shape[1] + step
                chunk = ids[:, :upto] if step == 0 else ids[:, upto - 1 : upto]
                out = model(chunk, past_key_values=cache, use_cache=True).logits[:, -1]
                assert 0 < _relative(out, want) <= KV_TOLERANCE[kv], (arch, kv, step, _relative(out, want))
    finally:
        model.weightstream.close()


@pytest.mark.parametrize("kv, stored", [("float16", torch.float16), ("q8_0", torch.uint8)])
def test_serve_cache_keeps_the_16bit_latent_and_the_engine_s_bits(tiny_model, kv, stored):
    """serve's batched caches (transformers' DynamicLayer rows) store the latent in the chosen dtype too, and a
    sequence decoded on one gives the engine cache's logits bitwise."""
    from weightstream.engine.kv_cache import stored_cache

    model_dir = tiny_model("deepseek_v3", **(Q8_SHAPE if kv == "q8_0" else {}))
    model = load_streaming_model(model_dir, expert_cache="100x", kv_dtype=kv)
    try:
        want_tokens, want, _ = _decode_steps(model, PROMPT, 5)
        tokens, got, cache = _decode_steps(model, PROMPT, 5, cache=stored_cache(model))
        assert {layer.keys.dtype for layer in cache.layers} == {stored}
        assert tokens == want_tokens
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        model.weightstream.close()


def test_a_16bit_cache_is_refused_where_it_cannot_apply(tiny_model):
    with pytest.raises(WeightstreamError, match="'int8': choose one of auto, float32, float16, bfloat16, q8_0"):
        load_streaming_model(tiny_model("deepseek_v3"), kv_dtype="int8")
    with pytest.raises(WeightstreamError, match="whole blocks of 32 values and this model's qk_rope_head_dim 8 is not"):
        load_streaming_model(tiny_model("deepseek_v3"), kv_dtype="q8_0")
    with pytest.raises(WeightstreamError, match="--latent-attention expanded runs transformers' form"):
        load_streaming_model(tiny_model("deepseek_v3", **Q8_SHAPE), kv_dtype="q8_0", latent_attention="expanded")
    with pytest.raises(WeightstreamError, match="--latent-attention expanded runs transformers' form"):
        load_streaming_model(tiny_model("deepseek_v3"), kv_dtype="float16", latent_attention="expanded")
    with pytest.raises(WeightstreamError, match=r"qwen3_moe\) has no latent attention.*drop --kv-dtype"):
        load_streaming_model(tiny_model("qwen3_moe"), kv_dtype="float16")


def test_a_16bit_cache_needs_plain_cache_layers(tiny_model):
    """A model whose cache layers are not transformers' plain DynamicLayer (a sliding window here; DeepSeek-V3.2's
    indexer in the field) refuses a 16-bit cache by name rather than keep some layers in float32 while --memory counts
    them at half."""
    from weightstream.engine.kv_cache import store_kv_in

    model = load_streaming_model(tiny_model("gpt_oss", sliding_window=6), expert_cache="1x")
    try:
        with pytest.raises(WeightstreamError, match="DynamicSlidingWindowLayer.*drop --kv-dtype"):
            store_kv_in(model, "float16", True, "absorbed", "m")
    finally:
        model.weightstream.close()


def test_a_float16_cache_of_a_bf16_model_holds_its_values_exactly(tiny_model):
    """A bf16 model computes its latent in bf16; float16 holds those values exactly (at these magnitudes), so the
    float16 cache gives the bf16 cache's logits bitwise, through the expanded prompt (40 rows: past rows_to_expand,
    the cache converted to the model's dtype) and the absorbed decode rows."""
    model_dir = tiny_model("deepseek_v3", "bf16")
    prompt = torch.arange(40).remainder(300).add(3).reshape(1, -1)
    runs = {}
    for kv in ("auto", "float16"):
        model = load_streaming_model(model_dir, expert_cache="100x", kv_dtype=kv)
        try:
            assert prompt.shape[1] >= model.model.layers[0].self_attn._ws_latent.expand_from
            tokens, logits, cache = _decode_steps(model, prompt, 5)
            assert {layer.keys.dtype for layer in cache.layers} == {torch.bfloat16 if kv == "auto" else torch.float16}
            runs[kv] = tokens, logits
        finally:
            model.weightstream.close()
    assert runs["auto"][0] == runs["float16"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["auto"][1], runs["float16"][1], strict=True))
