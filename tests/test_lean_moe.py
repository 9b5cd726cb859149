"""The one-row forms of DeepSeek's MoE blocks and of gated MLPs (engine/lean_moe.py): on quantized-dense tiny
models, decode with them gives the bits of the modules' own forwards, streamed and resident alike; they are put
only where they apply."""

import pytest
import torch

from weightstream import native
from weightstream.engine import lean_moe
from weightstream.engine.kv_cache import engine_cache
from weightstream.engine.lean_moe import install_lean_moe
from weightstream.engine.loader import load_streaming_model
from weightstream.store.quant.pipeline import quantize_checkpoint

PROMPT = torch.tensor([[3, 17, 101, 250, 7, 42, 311, 5]])


@pytest.fixture(autouse=True)
def _native_built():
    assert native.available(), native.why_not()


def _decode(model, steps: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's last-row logits, one row a step after the prompt."""
    cache, tokens, logits = engine_cache(model, PROMPT.shape[1] + steps), [], []
    with torch.inference_mode():
        out = model(PROMPT, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            logits.append(out.clone())
            token = out.argmax(-1, keepdim=True)
            tokens.append(int(token))
            out = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
    return tokens, logits


def _own_forwards(model) -> int:
    """Every module's class forward back in place of what install_lean_moe put; how many."""
    put = [m for m in model.modules() if "forward" in vars(m) and type(vars(m)["forward"]).__name__ in LEAN]
    for module in put:
        del module.forward
    return len(put)


LEAN = ("function", "_GatedRow")


@pytest.mark.parametrize(
    "arch,overrides,want",
    [
        ("deepseek_v3", {}, {"DeepseekV3MLP: gate and up in one product", "DeepseekV3MoE: one-row router"}),
        # groups that hide experts: transformers' router keeps its masks
        ("deepseek_v3", {"n_group": 2, "topk_group": 1}, {"DeepseekV3MLP: gate and up in one product"}),
        ("deepseek_v2", {}, {"DeepseekV2MLP: gate and up in one product", "DeepseekV2Moe: one-row router"}),
        (
            "deepseek_v2",
            {"n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy"},
            {"DeepseekV2MLP: gate and up in one product"},
        ),
        ("qwen2_moe", {}, {"Qwen2MoeMLP: gate and up in one product"}),
    ],
)
def test_decode_with_the_one_row_forms_gives_the_modules_bits(tiny_model, tmp_path, monkeypatch, arch, overrides, want):
    calls = {"router": 0, "gated": 0}
    gated = lean_moe._GatedRow.__call__

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    for name in ("_router", "_softmax_router"):
        monkeypatch.setattr(lean_moe, name, counted("router", getattr(lean_moe, name)))
    monkeypatch.setattr(lean_moe._GatedRow, "__call__", counted("gated", gated))
    out = str(tmp_path / "q")
    quantize_checkpoint(tiny_model(arch, "bf16", **overrides), out, 8, dense="int8")
    model = load_streaming_model(out, expert_cache="100x")
    streamed = load_streaming_model(out, expert_cache="1x", io_threads=3)
    try:
        assert (
            want <= set(model.weightstream.fused) and not {f for f in model.weightstream.fused if ": " in f} - want
        ), model.weightstream.fused
        tokens, logits = _decode(model)
        layers = model.config.num_hidden_layers
        routers = layers - getattr(model.config, "first_k_dense_replace", 0) if "one-row router" in str(want) else 0
        assert calls["router"] == 6 * routers and calls["gated"] >= 6 * layers // 2, calls
        streamed_tokens, streamed_logits = _decode(streamed)
        assert _own_forwards(model) > 0
        own_tokens, own_logits = _decode(model)
    finally:
        model.weightstream.close()
        streamed.weightstream.close()
    assert tokens == own_tokens == streamed_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, own_logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(logits, streamed_logits, strict=True))


def test_a_gated_mlp_keeps_one_copy_of_its_blocks_and_runs_its_own_forward_for_a_prompt(tiny_model, tmp_path):
    out = str(tmp_path / "q")
    quantize_checkpoint(tiny_model("deepseek_v3", "bf16"), out, 8, dense="int8")
    model = load_streaming_model(out, expert_cache="100x")
    try:
        mlp = model.model.layers[0].mlp
        gated = vars(mlp)["forward"]
        assert mlp.gate_proj.blocks.untyped_storage().data_ptr() == gated.blocks.untyped_storage().data_ptr()
        assert mlp.up_proj.blocks.data_ptr() == gated.blocks[mlp.gate_proj.out_features :].data_ptr()
        x = torch.randn(1, 5, model.config.hidden_size)
        with torch.inference_mode():
            assert torch.equal(mlp(x), type(mlp).forward(mlp, x))
            row = x[:, :1]
            assert torch.equal(mlp(row), type(mlp).forward(mlp, row))
        assert install_lean_moe(torch.nn.Linear(2, 2)) == []
    finally:
        model.weightstream.close()
