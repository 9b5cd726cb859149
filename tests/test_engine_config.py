"""EngineConfig: every option the engine takes, checked before anything loads (issue 49); the loader, the CLI and
serve take it, `generate --json` prints it."""

from __future__ import annotations

import json

import pytest
import torch

from weightstream.engine.config import EngineConfig
from weightstream.engine.loader import load_streaming_model
from weightstream.errors import WeightstreamError
from weightstream.serve.service import ServeSettings

from cli_support import refused_in_process

BAD = [
    ({"expert_source": "ssd"}, "--expert-source 'ssd': choose one of expert-cache, page-cache"),
    ({"expert_kernel": "fast"}, "fast"),
    ({"latent_attention": "folded"}, "--latent-attention 'folded'"),
    ({"policy": "arc"}, "--policy 'arc': choose one of"),
    ({"io_threads": 0}, "--io-threads 0: need at least 1"),
    ({"upgrade_after": 0}, "--upgrade-after 0"),
    ({"expert_cache": "lots"}, "'lots': not a size"),
    ({"memory": "abc"}, "--memory"),
    ({"memory": "1GiB", "expert_cache": "2GiB"}, "give one; --memory sizes the expert cache itself"),
    ({"memory": "1GiB", "expert_source": "page-cache"}, "page-cache has none"),
    ({"miss_copy": True, "expert_source": "page-cache"}, "--miss-copy"),
    ({"predict_next": True, "expert_source": "mmap"}, "--predict-next needs --expert-source expert-cache"),
    ({"warm_restart": True, "expert_source": "page-cache"}, "--warm-restart restores the expert cache"),
]


@pytest.mark.parametrize(("options", "words"), BAD, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD)])
def test_a_bad_option_is_refused_by_name(options, words):
    with pytest.raises(WeightstreamError) as caught:
        EngineConfig(**options)
    assert words in str(caught.value)


def test_a_change_is_checked_again_and_the_original_kept():
    config = EngineConfig(memory="1GiB")
    with pytest.raises(WeightstreamError, match="give one"):
        config.replace(expert_cache="1x")
    assert config.expert_cache is None and config.replace(context=64).context == 64
    with pytest.raises(AttributeError):  # frozen: nothing changes it behind the loader's back
        config.io_threads = 8


def test_old_source_names_are_read_and_the_dict_printed():
    config = EngineConfig(expert_source="direct", policy="pinned", policy_options={"pinned_keys": [(0, 1), (1, 2)]})
    assert config.expert_source == "expert-cache"
    out = config.to_dict()
    assert out["policy_options"] == {"pinned_keys": 2} and out["latent_attention"] == "absorbed"
    assert json.loads(json.dumps(out)) == out
    assert EngineConfig(memory="2GiB").memory_bytes == 2 * 2**30


def test_the_loader_takes_a_config_or_its_fields(tiny_model):
    """`load_streaming_model(path, config)` and the same options as keywords load the same engine; keywords go over
    the config's; the runtime keeps what it ran with."""
    model_dir = tiny_model("qwen3_moe")
    prompt = torch.tensor([[3, 5, 7, 11]])
    config = EngineConfig(expert_cache="1x", io_threads=2)
    logits = []
    for model in (
        load_streaming_model(model_dir, config),
        load_streaming_model(model_dir, expert_cache="1x", io_threads=2),
    ):
        try:
            with torch.inference_mode():
                logits.append(model(prompt).logits)
            assert model.weightstream.config == config
        finally:
            model.weightstream.close()
    assert torch.equal(logits[0], logits[1])
    model = load_streaming_model(model_dir, config, io_threads=1)
    try:
        assert model.weightstream.config == config.replace(io_threads=1)
    finally:
        model.weightstream.close()


def test_serve_settings_carry_a_config():
    assert ServeSettings("m", engine={"io_threads": 2}).engine == EngineConfig(io_threads=2)
    with pytest.raises(WeightstreamError, match="--memory"):
        ServeSettings("m", engine={"memory": "abc"})


def test_serve_refuses_a_bad_memory_before_binding(tiny_model, monkeypatch):
    """Issue 52's note: `serve --memory abc` bound the port and loaded before the size error; the config refuses it
    first."""

    def refuse(*args, **kwargs):
        raise AssertionError("serve bound or loaded before refusing --memory")

    monkeypatch.setattr("weightstream.serve.server.serve", refuse)
    code, err = refused_in_process("serve", tiny_model("qwen3_moe"), "--memory", "abc")
    assert code == 2 and "Traceback" not in err and "--memory" in err and "abc" in err, err


def test_generate_json_prints_the_engine(tiny_model, capsys):
    from weightstream.cli import main

    code = main(
        [
            "generate",
            tiny_model("qwen3_moe"),
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
            "--json",
            "--io-threads",
            "2",
        ]
    )
    assert code == 0
    engine = json.loads(capsys.readouterr().out)["stats"]["engine"]
    assert engine["io_threads"] == 2 and engine["expert_source"] == "expert-cache" and engine["expert_cache"] is None
