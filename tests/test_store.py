"""Checkpoint index: our header parser against safetensors' own, and malformed files rejected cleanly."""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import open_checkpoint
from weightstream.store.safetensors_index import read_safetensors_header


def write_raw(path, header: dict, data: bytes = b"", header_len: int | None = None):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def snapshot(directory):
    return {
        p: (os.path.getsize(os.path.join(directory, p)), os.path.getmtime(os.path.join(directory, p)))
        for p in sorted(os.listdir(directory))
    }


def test_offsets_match_safetensors(tmp_path):
    tensors = {
        "a": torch.arange(7, dtype=torch.float32),
        "b": torch.ones(3, 5, dtype=torch.bfloat16),
        "c": torch.zeros(0, dtype=torch.int64),
    }
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path)
    infos = read_safetensors_header(path)
    with open(path, "rb") as f, safe_open(path, "pt") as st:
        for name, info in infos.items():
            f.seek(info.offset)
            raw = f.read(info.nbytes)
            expected = st.get_tensor(name)
            assert info.shape == tuple(expected.shape)
            assert raw == expected.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("truncated_length", "truncated safetensors file"),
        ("truncated_header", "truncated safetensors header"),
        ("oversized_header", "exceeds the format's"),
        ("past_eof", "past the end of the file"),
        ("overlap", "overlap"),
        ("unknown_dtype", "unknown dtype"),
        ("not_json", "not valid JSON"),
        ("wrong_length", "needs 16"),
    ],
)
def test_malformed_files_rejected(tmp_path, case, pattern):
    path = str(tmp_path / "bad.safetensors")
    good = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    if case == "truncated_length":
        open(path, "wb").write(b"\x01\x02")
    elif case == "truncated_header":
        write_raw(path, good, header_len=10_000)
    elif case == "oversized_header":
        write_raw(path, good, header_len=2**40)
    elif case == "past_eof":
        write_raw(path, good, b"\0" * 8)
    elif case == "overlap":
        write_raw(
            path,
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            b"\0" * 24,
        )
    elif case == "unknown_dtype":
        write_raw(path, {"t": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)
    elif case == "not_json":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 5) + b"{nope")
    elif case == "wrong_length":
        write_raw(path, {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12)
    before = snapshot(tmp_path)
    with pytest.raises(WeightstreamError, match=pattern) as info:
        read_safetensors_header(path)
    assert path in str(info.value)
    assert snapshot(tmp_path) == before  # nothing written anywhere


def test_missing_shard_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    )
    before = snapshot(tmp_path)
    with pytest.raises(WeightstreamError, match="model-2.safetensors"):
        open_checkpoint(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_missing_config_and_empty_dir(tmp_path):
    with pytest.raises(WeightstreamError, match="config.json"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightstreamError, match="no \\*.safetensors"):
        open_checkpoint(str(tmp_path))


def test_sharded_checkpoint_indexes_every_tensor(tiny_model):
    ckpt = open_checkpoint(tiny_model("mixtral"))
    assert len(ckpt.files) > 1
    with open(os.path.join(ckpt.model_dir, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(ckpt.tensors)


@pytest.mark.parametrize(
    "arch, cls", [("mixtral", "MixtralForCausalLM"), ("olmoe", "OlmoeForCausalLM"), ("gpt_oss", "GptOssForCausalLM")]
)
def test_synth_config_names_its_architecture(tiny_model, arch, cls):
    """Hub checkpoints name their class; converters (llama.cpp's convert_hf_to_gguf) refuse a config without it."""
    with open(os.path.join(tiny_model(arch), "config.json")) as f:
        assert json.load(f)["architectures"] == [cls]


def test_aligned_writer_round_trips_through_safetensors_and_aligns(tmp_path):
    import torch
    from safetensors import safe_open

    from weightstream.store.safetensors_writer import save_aligned

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bias": torch.randn(10, generator=gen),  # 40 bytes: placed after the aligned ones
        "w.bf16": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "w.f32": torch.randn(3, 64, generator=gen),
        "q": torch.randint(-128, 127, (128,), dtype=torch.int8),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    save_aligned(tensors, str(path), metadata={"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors) and f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name
    index = read_safetensors_header(str(path))
    for name, t in tensors.items():
        if t.numel() * t.element_size() % 64 == 0:
            assert index[name].offset % 64 == 0, name


def test_synth_experts_are_64_byte_aligned(tiny_model):
    ckpt = open_checkpoint(tiny_model("qwen3_moe", "bf16"))
    assert all(t.offset % 64 == 0 for n, t in ckpt.tensors.items() if ".experts." in n)
