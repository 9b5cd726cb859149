"""tune's budget arithmetic: KV bytes against transformers' own cache, real configs against published sizes, and the
budget `tune` divides for a checkpoint (`sim.budget.checkpoint_budget`, through `budget_of` as these tests are)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from weightstream.cgroup import margin_for
from weightstream.engine.kv_cache import quiet_cache_kwarg
from weightstream.errors import WeightstreamError
from weightstream.sim.budget import RUNTIME_OVERHEAD_BYTES, Budget, budget_of
from weightstream.store.facts import kv_cache_bytes
from weightstream.store.layout import experts_modules
from weightstream.store.presets import REAL, TINY, preset_config
from weightstream.trace.shapes import shape_from_config
from weightstream.units import GIB, MIB


def _config(fields: dict):
    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def dense_tensors_of_config(fields: dict) -> dict[str, int]:
    """Bytes (bf16) of each parameter and buffer outside the experts modules of a model known by its config alone
    (a meta model): what a checkpoint's `ModelLayout.dense` holds, for the real models no test can download."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(fields), dtype=torch.bfloat16)
    experts = set(experts_modules(model))
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    seen, sizes = set(), {}
    for name, t in tensors:
        if name.rpartition(".")[0] not in experts and id(t) not in seen:
            seen.add(id(t))
            sizes[name] = t.numel() * t.element_size()
    return sizes


def budget_of_config(fields: dict, memory_bytes: int, context: int = 4096) -> Budget:
    """The shipped `budget_of` on a bf16 model known by its config fields (working set from its expert shape)."""
    working_set = shape_from_config(fields, "config", dtype_bytes=2).working_set_bytes
    return budget_of(_config(fields), memory_bytes, context, dense_tensors_of_config(fields), working_set, 2)


def _cache_storage_bytes(cache) -> int:
    """Bytes of the distinct storages behind a DynamicCache (a sliding layer's view keeps its whole tensor alive)."""
    seen = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.numel():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("arch", sorted(TINY))
def test_kv_bytes_equal_what_transformers_caches_after_a_decode_step(arch):
    fields = preset_config("tiny", arch)
    if arch == "gpt_oss":
        fields["sliding_window"] = 8  # shorter than the context, so the window is what is kept
    fields.pop("model_type")
    config = AutoConfig.for_model(TINY[arch]["model_type"], **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = 13
    with torch.inference_mode(), quiet_cache_kwarg():
        out = model(torch.arange(1, 1 + prompt).unsqueeze(0), use_cache=True)
        out = model(torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)
    expected = kv_cache_bytes(config.get_text_config(), prompt + 1, 4)
    assert _cache_storage_bytes(out.past_key_values) == expected


# Published parameter counts (bf16 here: 2 bytes each); gpt-oss-20b's experts are MXFP4 upstream, bf16 here.
PUBLISHED_PARAMS = {
    "olmoe-1b-7b": 6.92e9,
    "qwen3-30b-a3b": 30.5e9,
    "deepseek-v2-lite": 15.7e9,
    "deepseek-v3-lite": 15.7e9,  # not a published model: V2-Lite's sizes with V3's q_lora, within 0.3% of V2-Lite
    "mixtral-8x7b": 46.7e9,
    "gpt-oss-20b": 20.9e9,
    "glm-4.5-air": 106e9,  # without its MTP layer, which transformers does not build (110B with it)
}
KV_PER_TOKEN = {  # bytes per token, by hand from each config.json
    "olmoe-1b-7b": 16 * 2 * 16 * 128 * 2,  # layers x (k, v) x kv heads x head dim x bf16
    "qwen3-30b-a3b": 48 * 2 * 4 * 128 * 2,
    "deepseek-v2-lite": 27 * (512 + 64) * 2,  # MLA: the compressed latent and the rotary key, per layer
    "mixtral-8x7b": 32 * 2 * 8 * 128 * 2,
    "glm-4.5-air": 46 * 2 * 8 * 128 * 2,
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_dense_plus_experts_is_the_published_size(name):
    budget = budget_of_config(REAL[name], 64 * GIB, context=4096)
    shape = shape_from_config(REAL[name], name)
    experts = shape.n_experts * sum(shape.expert_bytes)
    assert (budget.dense_bytes + experts) / 2 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)
    resident = budget.dense_bytes - budget.lazy_dense_bytes
    overhead = RUNTIME_OVERHEAD_BYTES + margin_for(64 * GIB)  # what --memory keeps beyond the resident set too
    assert budget.expert_bytes == 64 * GIB - resident - budget.kv_cache_bytes - overhead
    assert budget.working_set_bytes == shape.working_set_bytes


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_untied_input_embedding_is_not_counted_resident(name):
    fields = REAL[name]
    config = AutoConfig.for_model(fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"})
    text = config.get_text_config()
    assert not getattr(text, "tie_word_embeddings", False)  # every real config here has a head of its own
    budget = budget_of_config(fields, 64 * GIB, context=4096)
    assert budget.lazy_dense_bytes == text.vocab_size * text.hidden_size * 2  # the embedding table, bf16


def test_a_tied_embedding_is_resident_since_the_head_reads_all_of_it():
    fields = dict(preset_config("tiny", "olmoe"), tie_word_embeddings=True)
    untied = dict(fields, tie_word_embeddings=False)
    assert budget_of_config(fields, 8 * GIB).lazy_dense_bytes == 0
    text = AutoConfig.for_model(untied["model_type"], **{k: v for k, v in untied.items() if k != "model_type"})
    assert budget_of_config(untied, 8 * GIB).lazy_dense_bytes == text.vocab_size * text.hidden_size * 2


@pytest.mark.parametrize("name", sorted(KV_PER_TOKEN))
def test_real_configs_kv_bytes_by_hand(name):
    assert budget_of_config(REAL[name], 64 * GIB, context=4096).kv_cache_bytes == 4096 * KV_PER_TOKEN[name]


def test_gpt_oss_sliding_layers_keep_their_window_only():
    fields = dict(REAL["gpt-oss-20b"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    per_layer_token = 2 * 8 * 64 * 2
    assert kv_cache_bytes(config, 4096, 2) == 12 * 4096 * per_layer_token + 12 * 128 * per_layer_token


def test_olmoe_dense_bytes_by_hand():
    h, v, layers, experts = 2048, 50304, 16, 64
    per_layer = 4 * h * h + 2 * h + 2 * h + experts * h  # q k v o, q/k norms, two layer norms, router
    rotary = 2 * 64 * 4  # inv_freq and original_inv_freq buffers, fp32, head dim 128 / 2
    expected = 2 * (2 * v * h + layers * per_layer + h) + rotary  # embeddings, lm_head, layers, final norm
    assert budget_of_config(REAL["olmoe-1b-7b"], 8 * GIB).dense_bytes == expected


def test_a_budget_below_one_working_set_is_refused_with_the_minimum():
    budget = budget_of_config(REAL["gpt-oss-20b"], 6 * GIB, context=4096)
    with pytest.raises(WeightstreamError, match=r"no expert cache fits. Use --memory (\d+\.\d+)GiB") as info:
        budget.check()
    minimum = float(info.value.args[0].split("Use --memory ")[1].split("GiB")[0])
    assert minimum * GIB == pytest.approx(budget.min_memory_bytes, abs=0.01 * GIB)
    fits = budget_of_config(REAL["gpt-oss-20b"], int(minimum * GIB) + 16 * MIB, context=4096)
    fits.check()  # the stated minimum is enough
    assert fits.expert_bytes >= fits.working_set_bytes


def test_budget_parts_add_up():
    b = Budget(8 * GIB, 1 * GIB, 512 * MIB, 512 * MIB, 2 * GIB, 4096)
    assert b.expert_bytes == 6 * GIB
    lazy = Budget(8 * GIB, 1 * GIB, 512 * MIB, 512 * MIB, 2 * GIB, 4096, lazy_dense_bytes=256 * MIB)
    assert lazy.resident_dense_bytes == 768 * MIB
    assert lazy.expert_bytes == 6 * GIB + 256 * MIB
    assert lazy.to_dict()["lazy_dense_bytes"] == 256 * MIB
    assert b.to_dict()["expert_bytes"] == 6 * GIB
    b.check()


@pytest.fixture(scope="module")
def bf16_and_quantized(tmp_path_factory):
    """A tiny bf16 OLMoE and its int4 and int8 quantizations."""
    from weightstream.store.quant.pipeline import quantize_checkpoint
    from weightstream.store.synth import synthesize

    root = tmp_path_factory.mktemp("budget")
    src = str(root / "bf16")
    synthesize(src, preset_config("tiny", "olmoe"), dtype="bf16", seed=3)
    quantized = {}
    for bits, group in ((4, 32), (8, None)):
        quantized[bits] = str(root / f"int{bits}")
        quantize_checkpoint(src, quantized[bits], bits, group)
    return src, quantized


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_checkpoint_budgets_the_kv_cache_its_attention_computes_in(bf16_and_quantized, bits):
    """The KV cache holds the attention's activations (bf16: the manifest's activation dtype), not the experts'
    int8 / uint8 weights: tune's budget of the quantized checkpoint has the bf16 one's KV bytes."""
    from weightstream.tune.session import TuneSession

    src, quantized = bf16_and_quantized
    bf16, quant = (TuneSession(d, GIB, 512, 4).budget for d in (src, quantized[bits]))
    assert bf16.kv_cache_bytes == 3 * 2 * 4 * 16 * 2 * 512  # layers x (k, v) x kv heads x head dim x bf16 x tokens
    assert quant.kv_cache_bytes == bf16.kv_cache_bytes
    assert (quant.dense_bytes, quant.lazy_dense_bytes) == (bf16.dense_bytes, bf16.lazy_dense_bytes)
    assert quant.expert_bytes == bf16.expert_bytes


def test_on_a_checkpoint_tune_budgets_what_the_config_alone_says(bf16_and_quantized):
    """The real-config tests above stand for checkpoints no test can download: on one it has, tune's budget has
    the dense bytes of the config's meta model (less the rotary buffers, made at load, never stored), its KV and
    its embedding left on disk; only the working set differs, counted in the cache's aligned slots."""
    from weightstream.tune.session import TuneSession

    fields = preset_config("tiny", "olmoe")
    session = TuneSession(bf16_and_quantized[0], GIB, 512, 4)
    tune, config = session.budget, budget_of_config(fields, GIB, 512)
    buffers = sum(n for name, n in dense_tensors_of_config(fields).items() if "rotary_emb" in name)
    assert tune.dense_bytes == config.dense_bytes - buffers
    assert (tune.kv_cache_bytes, tune.lazy_dense_bytes) == (config.kv_cache_bytes, config.lazy_dense_bytes)
    assert tune.working_set_bytes == session.layout.working_set_bytes > config.working_set_bytes


def test_tune_prices_a_16bit_latent_cache_and_says_so(tiny_model):
    """--kv-dtype float16 on a DeepSeek checkpoint: tune's KV bytes are half the float32 cache's, the refusal of a
    budget too small suggests it, and a model without latent attention refuses it as the engine does."""
    from weightstream.tune.report import generate_command
    from weightstream.tune.session import TuneSession

    model_dir = tiny_model("deepseek_v3")
    wide, half = (TuneSession(model_dir, GIB, 512, 4, kv).budget for kv in ("auto", "float16"))
    layers = preset_config("tiny", "deepseek_v3")["num_hidden_layers"]
    assert wide.kv_cache_bytes == layers * (32 + 8) * 4 * 512
    assert half.kv_cache_bytes == wide.kv_cache_bytes // 2
    assert half.expert_bytes == wide.expert_bytes + wide.kv_cache_bytes // 2
    with pytest.raises(WeightstreamError, match=r"shorter --context, or --kv-dtype float16: half the KV cache"):
        TuneSession(model_dir, 64 * MIB, 512, 4).budget.check()
    with pytest.raises(WeightstreamError, match=r"shorter --context\); below"):
        TuneSession(model_dir, 64 * MIB, 512, 4, "float16").budget.check()
    with pytest.raises(WeightstreamError, match=r"qwen3_moe\) has no latent attention.*drop --kv-dtype"):
        TuneSession(tiny_model("qwen3_moe"), GIB, 512, 4, "float16")
    blocks = tiny_model("deepseek_v3", qk_rope_head_dim=32, head_dim=32)  # whole q8_0 blocks
    q8 = TuneSession(blocks, GIB, 512, 4, "q8_0").budget
    assert q8.kv_cache_bytes == layers * 2 * 34 * 512
    with pytest.raises(WeightstreamError, match="qk_rope_head_dim 8 is not; give --kv-dtype float16"):
        TuneSession(model_dir, GIB, 512, 4, "q8_0")  # tune prices no cache the engine would refuse
    with pytest.raises(WeightstreamError, match=r"shorter --context, or --kv-dtype q8_0: 53% of the KV cache"):
        TuneSession(blocks, 64 * MIB, 512, 4, "float16").budget.check()
    rec = type("Rec", (), {"path": "expert-cache", "cache_bytes": 1 << 20, "policy": "lru", "extra": {}})()
    argv = generate_command(model_dir, rec, 4, 8, None, kv_dtype="float16")
    assert argv[argv.index("--kv-dtype") + 1] == "float16"
    assert "--kv-dtype" not in generate_command(model_dir, rec, 4, 8, None)
