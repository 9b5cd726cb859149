"""The one-row form of DeepSeek's MoE blocks (engine/lean_moe.py): on quantized-dense tiny models, decode with it
gives the bits of the modules' own forwards, streamed and resident alike; it is put only where it applies."""

import pytest
import torch

from weightstream import native
from weightstream.engine import lean_moe
from weightstream.engine.kv_cache import engine_cache
from weightstream.engine.lean_moe import install_lean_moe
from weightstream.engine.loader import load_streaming_model
from weightstream.store.quant.pipeline import quantize_checkpoint

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])
STEPS = 6


@pytest.fixture(autouse=True)
def _native_built():
    assert native.available(), native.why_not()


def _decode(model) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's last-row logits, one row a step after the prompt."""
    cache, tokens, logits = engine_cache(model, PROMPT.shape[1] + STEPS), [], []
    with torch.inference_mode():
        out = model(PROMPT, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(STEPS):
            logits.append(out.clone())
            token = out.argmax(-1, keepdim=True)
            tokens.append(int(token))
            out = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
    return tokens, logits


def _own_forwards(model) -> int:
    """The blocks' class forward back in place of what install_lean_moe put; how many."""
    put = [m for m in model.modules() if getattr(vars(m).get("forward"), "lean_moe", False)]
    for module in put:
        del module.forward
    return len(put)


@pytest.mark.parametrize(
    "arch,overrides,lean",
    [
        ("deepseek_v3", {}, "DeepseekV3MoE: one-row router"),
        ("deepseek_v3", {"n_group": 2, "topk_group": 1}, None),  # groups that hide experts: transformers' router
        ("deepseek_v2", {}, "DeepseekV2Moe: one-row router"),
        ("deepseek_v2", {"n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy"}, None),
        ("qwen2_moe", {}, None),
    ],
)
def test_decode_with_the_one_row_form_gives_the_modules_bits(tiny_model, tmp_path, monkeypatch, arch, overrides, lean):
    calls = []
    for name in ("_router", "_softmax_router"):
        router = getattr(lean_moe, name)
        monkeypatch.setattr(lean_moe, name, lambda *a, _r=router: calls.append(1) or _r(*a))
    out = str(tmp_path / "q")
    quantize_checkpoint(tiny_model(arch, "bf16", **overrides), out, 8, dense="int8")
    model = load_streaming_model(out, expert_cache="100x")
    streamed = load_streaming_model(out, expert_cache="1x", io_threads=3)
    try:
        assert [f for f in model.weightstream.fused if ": " in f] == ([lean] if lean else [])
        tokens, logits = _decode(model)
        moe_layers = model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
        assert len(calls) == STEPS * moe_layers * bool(lean)  # every decode row of every MoE layer
        streamed_tokens, streamed_logits = _decode(streamed)
        assert _own_forwards(model) == (moe_layers if lean else 0)
        own_tokens, own_logits = _decode(model)
    finally:
        model.weightstream.close()
        streamed.weightstream.close()
    assert tokens == own_tokens == streamed_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, own_logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(logits, streamed_logits, strict=True))


def test_a_router_with_hooks_runs_as_a_module(tiny_model, tmp_path):
    out = str(tmp_path / "q")
    quantize_checkpoint(tiny_model("deepseek_v3", "bf16"), out, 8, dense="int8")
    model = load_streaming_model(out, expert_cache="100x")
    try:
        seen = []
        gate = model.model.layers[1].mlp.gate
        gate.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[:-1].numel()))
        _decode(model)
        assert seen == [PROMPT.shape[1]] + [1] * STEPS  # the prompt's rows, then each decode row
        assert install_lean_moe(torch.nn.Linear(2, 2)) == []
    finally:
        model.weightstream.close()
