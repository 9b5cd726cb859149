"""Fuzzing the safetensors side of a model directory: the header parser (`read_safetensors_header`) and the shard
index (`model.safetensors.index.json`, read by `open_checkpoint`).

A valid file of tensors of several dtypes is damaged as bytes (the header length, the JSON, cut short) and as a
header rewritten with entries of the wrong type or range (dtype, shape, data_offsets, the entry itself, its
__metadata__); a two-shard directory gets index files of any JSON, text that is not UTF-8 and weight maps naming
missing, odd or malicious paths. The property: a WeightstreamError of one line naming the file (or directory), or
an index whose every tensor lies inside its file, holds prod(shape) x its dtype's bytes and reads back; never a
traceback or a hang, and the inputs unchanged.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightstream.errors import WeightstreamError
from weightstream.store.checkpoint import INDEX_NAME, open_checkpoint, read_bytes, read_tensor
from weightstream.store.dtypes import ELEMENT_BYTES, TORCH
from weightstream.store.safetensors_index import read_safetensors_header

from fuzz_support import (
    assert_clear,
    digest,
    fuzz,
    hostile_json,
    interesting_ints,
    json_values,
    mutated,
    outcome,
    time_limit,
)

TENSORS = {
    "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(2, 2, dtype=torch.float16),
    "scales": torch.arange(5, dtype=torch.uint8),
    "empty": torch.zeros(0, 3, dtype=torch.int64),
    "flag": torch.tensor([True, False]),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def header_of(raw: bytes) -> dict:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def with_header(raw: bytes, header, pad: bool = True) -> bytes:
    """The file with `header` (any JSON) in place of its own, the tensor bytes after it as they were."""
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n :]


def check_header(path: str) -> None:
    """read_safetensors_header(path): a one-line error naming it, or every tensor inside the file and readable."""
    before = digest(path)
    try:
        with time_limit(f"read_safetensors_header({path})"):
            tensors = read_safetensors_header(path)
    except WeightstreamError as exc:
        outcome("refused")  # --hypothesis-show-statistics counts them
        assert_clear(str(exc), path)
    else:
        outcome("read")
        size = os.path.getsize(path)
        (n,) = struct.unpack("<Q", open(path, "rb").read(8))
        for name, t in tensors.items():
            assert isinstance(name, str) and t.name == name and t.path == path
            assert t.dtype in ELEMENT_BYTES and all(type(d) is int and d >= 0 for d in t.shape), t
            assert 8 + n <= t.offset and t.offset + t.nbytes <= size, t
            assert t.nbytes == math.prod(t.shape) * ELEMENT_BYTES[t.dtype], t
            assert len(read_bytes(t.path, t.offset, t.nbytes)) == t.nbytes
            if t.dtype in TORCH:
                assert tuple(read_tensor(t).shape) == t.shape
    assert digest(path) == before, "reading the header changed the file"


@fuzz(150)
@given(data=st.data())
def test_damaged_safetensors_bytes_are_refused_by_name_or_read(base, tmp_path_factory, data):
    header_end = 8 + struct.unpack("<Q", base[:8])[0]
    raw = data.draw(mutated(base, fields=((0, 8),), hot=header_end), label="bytes")
    path = str(tmp_path_factory.getbasetemp() / "bytes.safetensors")
    with open(path, "wb") as f:
        f.write(raw)
    check_header(path)


def entry_edits():
    """One edit of a header entry: a field set to any JSON or to a near miss, dropped, or the entry replaced."""
    ints = st.one_of(st.integers(-3, 64), interesting_ints(64), st.sampled_from((2**64, 10**30)))
    near = {
        "dtype": st.one_of(st.sampled_from([*ELEMENT_BYTES, "f32", "F31", "", "BF16 ", "Q8_0"]), json_values()),
        "shape": st.one_of(st.lists(ints, max_size=4), st.lists(st.one_of(ints, json_values(2)), max_size=3)),
        "data_offsets": st.one_of(
            st.lists(ints, min_size=0, max_size=3), st.tuples(ints, ints).map(list), json_values(4)
        ),
    }
    return st.one_of(
        st.tuples(st.just("set"), st.sampled_from(sorted(near))).flatmap(
            lambda t: st.tuples(st.just(t[0]), st.just(t[1]), near[t[1]])
        ),
        st.tuples(st.just("drop"), st.sampled_from(sorted(near)), st.none()),
        st.tuples(st.just("replace"), st.none(), json_values()),
    )


@fuzz(150)
@given(data=st.data())
def test_wrong_header_entries_are_refused_by_name_or_read(base, tmp_path_factory, data):
    header = header_of(base)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        name = data.draw(st.sampled_from([*sorted(header), "new tensor", "__metadata__"]), label="entry")
        op, field, value = data.draw(entry_edits(), label="edit")
        entry = header.get(name)
        if op == "replace" or not isinstance(entry, dict):
            header[name] = value if op == "replace" else {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        elif op == "drop":
            entry.pop(field, None)
        else:
            entry[field] = value
    whole = data.draw(st.sampled_from((None, "json", "text")), label="whole header replaced")
    if whole == "json":
        header = data.draw(json_values(), label="header")
    raw = with_header(base, header, pad=data.draw(st.booleans(), label="padded"))
    if whole == "text":
        text = data.draw(hostile_json(), label="header text")
        (n,) = struct.unpack("<Q", base[:8])
        raw = struct.pack("<Q", len(text)) + text + base[8 + n :]
    path = str(tmp_path_factory.getbasetemp() / "header.safetensors")
    with open(path, "wb") as f:
        f.write(raw)
    check_header(path)


# ---------------------------------------------------------------------------------------------------- the index


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """config.json, two shards and their index, as transformers writes a sharded checkpoint."""
    folder = tmp_path_factory.mktemp("sharded") / "model"
    folder.mkdir()
    names = sorted(TENSORS)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: TENSORS[k] for k in keys}, str(folder / shard))
    index = {"metadata": {"total_size": 100}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (folder / "sub").mkdir()  # a directory a weight map may name
    return str(folder)


SHARD_NAMES = (
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "missing.safetensors",
    "config.json",
    "sub",
    "",
    ".",
    "..",
    "../model/model-00001-of-00002.safetensors",
    "/dev/null",
    "/etc/passwd",
    "model-00001-of-00002.safetensors\x00.txt",
    "dir/" * 40 + "x",
    "é.safetensors",
    "a" * 300,
)


def weight_maps():
    names = st.one_of(st.sampled_from(SHARD_NAMES), st.text(max_size=12), json_values(2))
    return st.one_of(
        st.dictionaries(st.text(max_size=10), names, max_size=4),
        st.dictionaries(st.sampled_from(sorted(TENSORS)), st.sampled_from(SHARD_NAMES[:2]), min_size=1),
        json_values(),
    )


@fuzz(150)
@given(data=st.data())
def test_any_index_is_refused_by_name_or_indexes_the_shards(model_dir, tmp_path_factory, data):
    folder = str(tmp_path_factory.getbasetemp() / "index-case")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model_dir, folder)
    index_path = os.path.join(folder, INDEX_NAME)
    kind = data.draw(st.sampled_from(("weight_map", "json", "bytes", "mutated", "hostile")), label="index")
    if kind == "weight_map":
        index = {"metadata": data.draw(json_values(), label="metadata"), "weight_map": data.draw(weight_maps())}
        text = json.dumps(index).encode()
    elif kind == "json":
        text = json.dumps(data.draw(json_values(), label="json")).encode()
    elif kind == "bytes":
        text = data.draw(st.binary(max_size=64), label="bytes")
    elif kind == "hostile":
        text = data.draw(hostile_json(), label="json text")
    else:
        with open(index_path, "rb") as f:
            text = data.draw(mutated(f.read()), label="mutated")
    with open(index_path, "wb") as f:
        f.write(text)
    before = digest(folder)
    try:
        with time_limit(f"open_checkpoint({folder})"):
            ckpt = open_checkpoint(folder)
    except WeightstreamError as exc:
        outcome("refused")
        assert_clear(str(exc), folder)
    else:
        outcome("indexed")
        assert set(ckpt.tensors) <= set(TENSORS), sorted(ckpt.tensors)
        for name, t in ckpt.tensors.items():
            assert t.shape == tuple(TENSORS[name].shape) and t.nbytes == TENSORS[name].nbytes, t
            if t.dtype in TORCH:
                assert torch.equal(read_tensor(t), TENSORS[name]), name
    assert digest(folder) == before, "indexing the checkpoint changed it"


def test_the_undamaged_inputs_read(base, model_dir, tmp_path_factory):
    """Where the fuzzers start: a file and a directory that read back whole."""
    path = str(tmp_path_factory.getbasetemp() / "whole.safetensors")
    with open(path, "wb") as f:
        f.write(with_header(base, header_of(base)))
    assert set(read_safetensors_header(path)) == set(TENSORS)
    ckpt = open_checkpoint(model_dir)
    assert set(ckpt.tensors) == set(TENSORS) and len(ckpt.files) == 2
    assert all(
        np.array_equal(read_tensor(t).float().numpy(), TENSORS[n].float().numpy()) for n, t in ckpt.tensors.items()
    )
