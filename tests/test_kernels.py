"""Expert kernels: the lean ones are used only where proven bitwise equal to eager; the view fallback stays exact."""

import pytest
import torch

from weightstream.commands.common import KERNEL_CHOICES
from weightstream.engine.kernels.choice import KERNELS, choose_kernel
from weightstream.engine.kernels.eager import EagerLinear, EagerMatmulBias, OneExpertEager, prove
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.store.layout import experts_modules

from engine_support import EXPANDED, greedy_logits, reference


def test_cli_choices_are_the_kernels():
    assert KERNEL_CHOICES == KERNELS


def _experts_module(model_dir):
    model = load_streaming_model(model_dir, expert_cache="1x", io_threads=1)
    model.weightstream.close()
    return next(iter(experts_modules(model).values()))


@pytest.mark.parametrize("arch, lean", [("olmoe", EagerLinear), ("gpt_oss", EagerMatmulBias)])
def test_prove_accepts_the_matching_kernel_and_rejects_others(tiny_model, arch, lean):
    module = _experts_module(tiny_model(arch, "bf16"))
    assert prove(lean(module), module)
    other = EagerMatmulBias if lean is EagerLinear else EagerLinear
    assert not prove(other(module), module)

    class OffByALastBit(lean):
        def __call__(self, rows, weights, params):
            return super().__call__(rows, weights * (1 + 2**-7), params)

    assert not prove(OffByALastBit(module), module)


def test_forcing_a_kernel_that_is_not_eager_is_refused(tiny_model):
    with pytest.raises(
        WeightstreamError, match="eager-linear: not bitwise equal to the eager forward of GptOssExperts"
    ):
        load_streaming_model(tiny_model("gpt_oss"), expert_kernel="eager-linear")
    with pytest.raises(WeightstreamError, match="--expert-kernel 'fast': choose one of auto"):
        load_streaming_model(tiny_model("olmoe"), expert_kernel="fast")


def test_auto_falls_back_to_the_view_when_no_lean_kernel_is_proven(tiny_model, monkeypatch):
    module = _experts_module(tiny_model("olmoe"))
    monkeypatch.setattr("weightstream.engine.kernels.eager.prove", lambda kernel, module: False)
    assert isinstance(choose_kernel(module), OneExpertEager)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_the_one_expert_view_is_bitwise_eager_too(tiny_model, arch, dtype):
    model_dir = tiny_model(arch, dtype)
    expected_tokens, expected_logits = reference(model_dir, dtype)
    model = load_streaming_model(
        model_dir, expert_cache="1x", io_threads=2, expert_kernel="one-expert-eager", **EXPANDED
    )
    try:
        tokens, logits = greedy_logits(model)
        assert model.weightstream.kernels == {type(_experts_module(model_dir)).__name__: "one-expert-eager"}
    finally:
        model.weightstream.close()
    assert tokens == expected_tokens
    assert all(torch.equal(g, w) for g, w in zip(logits, expected_logits, strict=True))


def test_a_refused_load_leaves_no_io_thread_running(tiny_model):
    import threading

    with pytest.raises(WeightstreamError):
        load_streaming_model(tiny_model("gpt_oss"), expert_kernel="eager-linear")
    with pytest.raises(WeightstreamError, match="--predict-next"):
        load_streaming_model(tiny_model("olmoe"), expert_source="page-cache", predict_next=True)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ws-io")]
