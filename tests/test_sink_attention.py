"""gpt-oss's attention with sinks over long contexts (engine/sink_attention.py): flash attention plus the sink's
per-row rescaling for long prompts, and the query heads grouped by key head for decode rows over a long cache,
each equal to transformers' eager within rounding, the sliding window and chunked prompts included, and bitwise
the same streamed or resident; small shapes still run eager, bitwise transformers'."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv

from weightstream.engine import sink_attention
from weightstream.engine.loader import load_streaming_model

from engine_support import greedy_run

# relative to the logits' largest magnitude: float32 sums in flash attention's order (measured below 1e-6)
TOLERANCE = 1e-5
# bf16: transformers' eager attention computes its scores and softmax in bf16, flash attention accumulates in float32,
# so the two are not within rounding of each other (0.26 on this random model's 40 positions); each is held to the
# float32 model instead, flash no farther than eager's own bf16 (measured 0.2894 against eager's 0.2879)
AS_FAR_AS_EAGER = 1.05
LONG = (torch.arange(40) * 37 + 3).remainder(500).add(5).reshape(1, -1)  # past the tiny model's 16-token window


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.fixture
def always_flash(monkeypatch):
    """Every forward of more than one row through flash attention (the tiny model's matrices are all small)."""
    monkeypatch.setattr(sink_attention, "EAGER_BELOW", 2)


def _gpt_oss(tiny_model, dtype: str) -> str:
    return tiny_model("gpt_oss", dtype, sliding_window=16)


def test_the_sink_is_a_per_row_scale_of_flash_attention(always_flash):
    """On random tensors with GQA, an additive sliding-window mask and a row that sees no key: the flash path equals
    the eager function it replaces within float32 rounding."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)

    class Module(torch.nn.Module):
        num_key_value_groups, training = 4, False
        sinks = torch.randn(8) * 3

    module = Module()
    module._ws_eager = eager_attention_forward
    rows = keys = 24
    q, k, v = torch.randn(1, 8, rows, 16), torch.randn(1, 2, keys, 16), torch.randn(1, 2, keys, 16)
    allowed = torch.ones(rows, keys, dtype=torch.bool).tril().triu(-6)
    allowed[5] = False  # a row that sees nothing: all its weight on the sink, an output of zeros
    mask = torch.zeros(rows, keys).masked_fill(~allowed, float("-inf"))[None, None]
    got, _ = sink_attention._forward(module, q, k, v, mask, scaling=0.25)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape and torch.equal(got[:, 5], torch.zeros_like(got[:, 5]))
    assert _relative(got, want) < 2e-6


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flash_with_sinks_gives_transformers_logits_within_rounding(tiny_model, always_flash, dtype):
    model_dir = _gpt_oss(tiny_model, dtype)
    with torch.inference_mode():
        exact = _eager_logits(model_dir, torch.float32)
        eager = _eager_logits(model_dir, torch.bfloat16) if dtype == "bf16" else exact
    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2)
    try:
        assert sum(hasattr(m, "_ws_eager") for m in model.modules()) == model.config.num_hidden_layers
        with torch.inference_mode():
            got = model(LONG).logits
    finally:
        model.weightstream.close()
    if dtype == "fp32":
        assert _relative(got, exact) < TOLERANCE
    else:
        assert _relative(got, exact) <= AS_FAR_AS_EAGER * _relative(eager, exact)


def _eager_logits(model_dir: str, dtype: torch.dtype) -> torch.Tensor:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
    return ref(LONG).logits


def test_streamed_equals_resident_and_chunks_equal_one_prompt(tiny_model, always_flash):
    """Bitwise: a 1x cache with 8 I/O threads and every expert resident take the same path; a prompt prefilled in
    chunks (their rows after cached positions: the causal mask offset) gives one prompt's tokens."""
    model_dir = _gpt_oss(tiny_model, "fp32")
    tokens, logits, _ = greedy_run(model_dir, LONG, 6, expert_cache="100x", io_threads=2)
    streamed_tokens, streamed, _ = greedy_run(model_dir, LONG, 6, expert_cache="1x", io_threads=8)
    assert streamed_tokens == tokens and all(torch.equal(a, b) for a, b in zip(streamed, logits, strict=True))
    from weightstream.engine.generate import generate

    model = load_streaming_model(model_dir, expert_cache="100x", io_threads=2)
    try:
        chunked, _ = generate(model, LONG, 6, prefill_chunk=16)
    finally:
        model.weightstream.close()
    assert chunked[0].tolist() == tokens[LONG.shape[1] :]


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_heads_are_eager_without_its_copies(rows, window):
    """Decode rows over a long cache: each key head's query heads as rows of one product (no repeat_kv copies),
    eager's arithmetic otherwise, the sliding window's mask and the sink included; a sliding layer's hidden keys
    left out."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(rows)

    class Module(torch.nn.Module):
        num_key_value_groups, training = 4, False
        sinks = torch.randn(8) * 3

    module, keys = Module(), 50
    module.sliding_window = window  # 21: the keys before the window are left out, not only masked
    q, k, v = torch.randn(1, 8, rows, 16), torch.randn(1, 2, keys, 16), torch.randn(1, 2, keys, 16)
    allowed = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows).triu(keys - rows - 20)  # a 21-key window
    mask = torch.zeros(rows, keys).masked_fill(~allowed, float("-inf"))[None, None]
    got, _ = sink_attention._grouped(module, q, k, v, mask, 0.25)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape and _relative(got, want) < 2e-6


def test_grouped_decode_gives_transformers_tokens_and_streams_bitwise(tiny_model, monkeypatch):
    """Every forward the tiny model runs through the grouped path: greedy tokens and logits of transformers' eager
    model within rounding, and a streamed run bitwise the resident one."""
    monkeypatch.setattr(sink_attention, "REPEAT_BELOW", 1)
    model_dir = _gpt_oss(tiny_model, "fp32")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.inference_mode():
        want = ref.generate(LONG, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, logits, _ = greedy_run(model_dir, LONG, 6, expert_cache="100x", io_threads=2)
    assert tokens == want.sequences[0].tolist()
    assert max(_relative(g, w) for g, w in zip(logits, want.logits, strict=True)) < TOLERANCE
    streamed_tokens, streamed, _ = greedy_run(model_dir, LONG, 6, expert_cache="1x", io_threads=8)
    assert streamed_tokens == tokens and all(torch.equal(a, b) for a, b in zip(streamed, logits, strict=True))


def test_small_matrices_stay_eager(tiny_model):
    """At the default threshold the tiny model's forwards all run transformers' eager function (bitwise its logits,
    tests/test_engine_exact.py), and a 4096-token prompt of gpt-oss-20b's 64 heads would not."""
    assert 64 * 4096 * 4096 >= sink_attention.EAGER_BELOW > 64 * 1 * 131072  # decode rows: no flash at any depth
    assert 64 * 4096 * 64 >= sink_attention.REPEAT_BELOW > 4 * 512 * 64  # the tiny model's keys: eager's copies


def test_memory_reserves_a_late_flash_chunk_without_eager_scores(tiny_model):
    """--memory's reserve for a forward late in the context (store/facts.py `context_temporaries`): where every
    attention is a sink attention whose late chunk takes the flash path, it holds a layer's keys and values and the
    chunk's masks, not eager's scores over the chunk nor keys repeated for every query head, and what the forwards
    under the threshold make (eager's scores, at most EAGER_BELOW elements) (3.5 GiB at 16k positions on
    gpt-oss-20b's 2-layer shape, refused at --memory 1 GiB asking for 5546 MiB: docs/benchmarks.md)."""
    from types import SimpleNamespace

    from weightstream.store.facts import context_temporaries

    oss = SimpleNamespace(num_attention_heads=64, num_key_value_heads=8, head_dim=64, hidden_size=2880)
    layer = 16400 * 2 * 8 * 64 * 4  # one layer's keys and values, float32
    eager = context_temporaries(oss, 16400, 256, 4, eager=True)
    assert eager == 8 * layer + 64 * 256 * 16400 * (4 + 2 * 4)
    below = sink_attention.EAGER_BELOW
    flash = context_temporaries(oss, 16400, 256, 4, eager=False, flash_below=below)
    # the chunk's masks, and eager's scores and softmax of the forwards under the threshold (decode rows, a short
    # last chunk, sliding-window layers), at most `below` elements each
    assert flash == layer + 256 * 16400 * (4 + 3) + below * (4 + 2 * 4)
    assert flash < eager / 10
    small = context_temporaries(oss, 100, 2, 4, eager=False, flash_below=below)
    assert small == 100 * 2 * 8 * 64 * 4 + 2 * 100 * 7 + 64 * 2 * 100 * 12  # under the threshold: its own size

    model = load_streaming_model(_gpt_oss(tiny_model, "fp32"), expert_cache="100x")
    try:
        heads = model.config.num_attention_heads
        rows = 256
        below = (sink_attention.EAGER_BELOW - 1) // (heads * rows)  # keys at which a chunk still runs eager
        assert not sink_attention.sinks_run_flash(model, rows, below)
        assert sink_attention.sinks_run_flash(model, rows, below + 1)
        attention = next(m for m in model.modules() if sink_attention.has_sinks(m))
        del attention._ws_eager  # one attention left to transformers' eager: its scores are what a chunk holds
        assert not sink_attention.sinks_run_flash(model, rows, 10**6)
    finally:
        model.weightstream.close()
    qwen = load_streaming_model(tiny_model("qwen3_moe", "fp32"), expert_cache="100x")
    try:
        assert not sink_attention.sinks_run_flash(qwen, rows, 10**6)  # no sinks: not this path
    finally:
        qwen.weightstream.close()


@pytest.mark.parametrize("groups, rows, keys", [(8, 7, 300), (4, 1, 129), (2, 5, 64), (3, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_by_offset_is_the_repeated_form_bitwise(groups, rows, keys, dtype):
    """The flash path's one call per offset within the groups gives torch's flash attention over the keys repeated
    for every query head (repeat_kv), bitwise: output and log-sum-exp, masked or not, on a strided query."""
    gen = torch.Generator().manual_seed(groups * 100 + rows)
    kv, dim = 2, 16
    query = torch.randn(1, rows, kv * groups, dim, generator=gen).transpose(1, 2).to(dtype)  # the attention's layout
    key, value = (torch.randn(1, kv, keys, dim, generator=gen).to(dtype) for _ in range(2))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for mask in (None, sink_attention._additive(None, rows, keys, dtype)):
        want = flash(query, repeat_kv(key, groups), repeat_kv(value, groups), 0.0, False, attn_mask=mask, scale=0.3)
        got = sink_attention._flash_by_offset(query, key, value, mask, 0.3, groups)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
