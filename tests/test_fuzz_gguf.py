"""Fuzzing `weightstream import` (the GGUF reader, config mapping, planner and importer) with damaged files.

Valid tiny qwen3moe GGUFs (F32 experts: a plain checkpoint; Q8_0 experts: blobs; a model split in two parts, with a
tokenizer in its metadata) are damaged two ways: as bytes (cut short, bytes flipped, the header's counts, lengths,
type ids, dims and offsets given interesting values, bytes inserted or deleted), and as a file written whole with
metadata values of the wrong type or range, tensors missing, reshaped or retyped. Each goes through the command
as a user runs it (the CLI's `main`, in this process). The property: exit 0 with the model directory written, or
exit 2 with one line naming the file, nothing left behind; never a traceback or a hang, and the GGUF unchanged.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue
from hypothesis import given
from hypothesis import strategies as st

from cli_support import assert_one_line_error, ran_in_process
from fuzz_support import Shown, digest, fuzz, interesting_ints, mutated, outcome, time_limit

ARCH = "qwen3moe"
H, HEADS, KV, HD, E, TOP_K, INTER, VOCAB = 64, 2, 1, 32, 4, 2, 32, 64
U32, F32, STR, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY
TOKENS = [chr(c) for c in range(ord("!"), ord("!") + VOCAB - 4)] + ['!"', "#$", "<|bos|>", "<|eos|>"]


def metadata(tokenizer: bool) -> dict[str, GGUFValue]:
    """The keys llama.cpp's converter writes for a Qwen3 MoE model, with their GGUF types."""
    meta = {
        f"{ARCH}.block_count": GGUFValue(1, U32),
        f"{ARCH}.context_length": GGUFValue(64, U32),
        f"{ARCH}.embedding_length": GGUFValue(H, U32),
        f"{ARCH}.feed_forward_length": GGUFValue(INTER, U32),
        f"{ARCH}.expert_feed_forward_length": GGUFValue(INTER, U32),
        f"{ARCH}.attention.head_count": GGUFValue(HEADS, U32),
        f"{ARCH}.attention.head_count_kv": GGUFValue(KV, U32),
        f"{ARCH}.attention.key_length": GGUFValue(HD, U32),
        f"{ARCH}.attention.value_length": GGUFValue(HD, U32),
        f"{ARCH}.rope.freq_base": GGUFValue(10000.0, F32),
        f"{ARCH}.attention.layer_norm_rms_epsilon": GGUFValue(1e-6, F32),
        f"{ARCH}.expert_count": GGUFValue(E, U32),
        f"{ARCH}.expert_used_count": GGUFValue(TOP_K, U32),
        "general.file_type": GGUFValue(7, U32),
        # an array of single bytes: gguf's reader read an array count past the file's end as empty items, forever
        "general.fuzz.bytes": GGUFValue(list(range(16)), ARR, GGUFValueType.UINT8),
    }
    if tokenizer:
        meta |= {
            "tokenizer.ggml.model": GGUFValue("gpt2", STR),
            "tokenizer.ggml.pre": GGUFValue("gpt-2", STR),
            "tokenizer.ggml.tokens": GGUFValue(TOKENS, ARR, STR),
            "tokenizer.ggml.token_type": GGUFValue([1] * (VOCAB - 2) + [3, 3], ARR, GGUFValueType.INT32),
            "tokenizer.ggml.merges": GGUFValue(['! "', "# $"], ARR, STR),
            "tokenizer.ggml.bos_token_id": GGUFValue(VOCAB - 2, U32),
            "tokenizer.ggml.eos_token_id": GGUFValue(VOCAB - 1, U32),
        }
    return meta


def tensors(expert_type: str, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (GGML type, data): F32 dense weights and norms, experts stacked (experts, out, in) as F32 or Q8_0
    blocks (uint8 (..., row bytes) with sane fp16 scales)."""
    rng = np.random.default_rng(seed)

    def f32(*shape):
        return "F32", (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def q8(*shape):
        raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 32, 34), dtype=np.uint8)
        raw[..., 0:2] = np.full((*shape[:-1], shape[-1] // 32, 1), 1e-3, np.float16).view(np.uint8)
        return "Q8_0", raw.reshape(*shape[:-1], -1)

    expert = f32 if expert_type == "F32" else q8
    return {
        "token_embd.weight": f32(VOCAB, H),
        "output_norm.weight": f32(H),
        "blk.0.attn_norm.weight": f32(H),
        "blk.0.attn_q.weight": f32(HEADS * HD, H),
        "blk.0.attn_k.weight": f32(KV * HD, H),
        "blk.0.attn_v.weight": f32(KV * HD, H),
        "blk.0.attn_output.weight": f32(H, HEADS * HD),
        "blk.0.attn_q_norm.weight": f32(HD),
        "blk.0.attn_k_norm.weight": f32(HD),
        "blk.0.ffn_norm.weight": f32(H),
        "blk.0.ffn_gate_inp.weight": f32(E, H),
        "blk.0.ffn_gate_exps.weight": expert(E, INTER, H),
        "blk.0.ffn_up_exps.weight": expert(E, INTER, H),
        "blk.0.ffn_down_exps.weight": expert(E, H, INTER),
    }


def write(path: str, meta: dict[str, GGUFValue], weights: dict[str, tuple[str, np.ndarray]], split: int = 0):
    """A GGUF file (or the parts of a split one, `split` tensors a part) as llama.cpp's converter writes it."""
    w = GGUFWriter(path, ARCH, split_max_tensors=split)
    w.kv_data[0].update(meta)
    for name, (kind, data) in weights.items():
        raw = None if kind == "F32" else GGMLQuantizationType[kind]
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data in weights.values():
        w.write_tensor_data(data)
    w.close()


def number_fields(path: str) -> tuple[tuple[int, int], ...]:
    """(offset, size) of every 4- or 8-byte number of the header: counts, lengths, value types, array counts, tensor
    dims, types and data offsets."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    out = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype.itemsize in (4, 8) and part.dtype.kind in "ui" and part.size <= 8:
                at = part.ctypes.data - base
                out += [(at + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(part.size)]
    return tuple(sorted(set(out)))


def count_fields(path: str) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """((offset, size) of each array's count, of every count and length of the header): tensors and keys, key and
    string lengths, array counts, tensor name lengths and dims; what a reader loops over or reads that many bytes
    of."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    arrays, out = [], []
    for field in reader.fields.values():
        parts = field.parts if field.name.startswith("GGUF.") else field.parts[:1]  # the counts, a key's length
        if field.types and field.types[0] == STR and len(field.parts) > 3:
            parts = [*parts, field.parts[3]]  # a string value's length
        if field.types and field.types[0] == ARR:
            parts = [*parts, field.parts[4]]  # an array's count
            arrays.append((field.parts[4].ctypes.data - base, 8))
        out += [(p.ctypes.data - base, p.dtype.itemsize) for p in parts if p.dtype.itemsize in (4, 8)]
    for t in reader.tensors:
        name_len, _, n_dims = t.field.parts[:3]
        out += [(p.ctypes.data - base, p.dtype.itemsize) for p in (name_len, n_dims)]
    return tuple(arrays), tuple(sorted(set(out)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name -> [(file name, bytes, number fields, where the tensor data starts, count fields)], one per part."""
    folder = tmp_path_factory.mktemp("gguf-bases")
    out = {}
    for name, kind, split in (("f32", "F32", 0), ("q8_0", "Q8_0", 0), ("split", "Q8_0", 8)):
        path = str(folder / f"{name}.gguf")
        write(path, metadata(tokenizer=name == "split"), tensors(kind), split)
        files = sorted(p for p in os.listdir(folder) if p.startswith(name))
        parts = []
        for file in files:
            full = str(folder / file)
            with open(full, "rb") as f:
                data = f.read()
            parts.append((file, data, number_fields(full), GGUFReader(full).data_offset, count_fields(full)))
        out[name] = parts
    return Shown(out, "the GGUF files fuzzed")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-fuzz")


def check_import(folder, files: list[str]) -> None:
    """`weightstream import` of the first of `files` (in `folder`): the model written, or one line naming a file
    and nothing left behind; the files unchanged."""
    paths = [os.path.join(folder, f) for f in files]
    before = [digest(p) for p in paths]
    out = os.path.join(folder, "out")
    with time_limit(f"weightstream import {paths[0]}"):
        code, stdout, err = ran_in_process("import", paths[0], "--out", out)
    assert [digest(p) for p in paths] == before, "the import changed its input"
    outcome("imported" if code == 0 else "refused")  # --hypothesis-show-statistics counts them
    if code == 0:
        assert os.path.isfile(os.path.join(out, "config.json")) and stdout.startswith(f"wrote {out}"), (stdout, err)
        shutil.rmtree(out)
    else:
        assert_one_line_error(code, err, "import")
        assert any(p in err for p in paths), err  # the file (or the part) at fault is named
        assert not os.path.exists(out), err
    left = [p for p in os.listdir(folder) if p.startswith(".")]
    assert not left, left  # no half-built directory beside --out


def test_the_undamaged_files_import(bases, work):
    """Where the fuzzers start: files that import (with their tokenizer), so what they find is the damage's doing."""
    for name, parts in bases.items():
        folder = work / f"whole-{name}"
        folder.mkdir()
        for file, raw, *_ in parts:
            (folder / file).write_bytes(raw)
        write(str(folder / "meta.gguf"), metadata(tokenizer=True), tensors("F32" if name == "f32" else "Q8_0"))
        for file in (parts[0][0], "meta.gguf"):
            out = folder / f"out-{file}"
            code, stdout, err = ran_in_process("import", folder / file, "--out", out)
            assert code == 0 and (out / "config.json").is_file(), err
            assert (out / "tokenizer.json").is_file() == (file == "meta.gguf" or name == "split"), err


@fuzz(150)
@given(data=st.data(), base=st.sampled_from(("f32", "q8_0", "split")))
def test_damaged_gguf_bytes_are_refused_by_name_or_import(bases, work, data, base):
    parts = bases[base]
    damaged = data.draw(st.integers(0, len(parts) - 1), label="part")
    folder = work / "bytes"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for i, (file, raw, fields, data_start, counts) in enumerate(parts):
        how = data.draw(st.sampled_from(("array count", "count or length", "bytes", "bytes")), label="damage")
        if i == damaged and how != "bytes":  # huge, zero, off by one
            at, width = data.draw(st.sampled_from(counts[how == "count or length" or not counts[0]]), label="field")
            value = data.draw(interesting_ints(8 * width), label="value")
            raw = raw[:at] + value.to_bytes(width, "little") + raw[at + width :]
        elif i == damaged:
            raw = data.draw(mutated(raw, fields, hot=data_start), label="bytes")
        (folder / file).write_bytes(raw)
    check_import(str(folder), [file for file, *_ in parts])


# -------------------------------------------------------------------------------- well-formed files, wrong content

SCALARS = {
    GGUFValueType.UINT8: 8,
    GGUFValueType.INT8: -8,
    GGUFValueType.UINT16: 16,
    GGUFValueType.INT16: -16,
    GGUFValueType.UINT32: 32,
    GGUFValueType.INT32: -32,
    GGUFValueType.UINT64: 64,
    GGUFValueType.INT64: -64,
}


KINDS = [*SCALARS, F32, GGUFValueType.FLOAT64, GGUFValueType.BOOL, STR]


@st.composite
def scalar_values(draw, kind: GGUFValueType | None = None) -> GGUFValue:
    kind = draw(st.sampled_from(KINDS)) if kind is None else kind
    if kind in SCALARS:
        bits = SCALARS[kind]
        value = draw(interesting_ints(abs(bits)))
        if bits < 0:  # the same bit pattern, read as signed
            value -= (value >= 2 ** (-bits - 1)) * 2**-bits
        return GGUFValue(value, kind)
    if kind in (F32, GGUFValueType.FLOAT64):
        return GGUFValue(draw(st.floats(width=32 if kind == F32 else 64)), kind)
    if kind == GGUFValueType.BOOL:
        return GGUFValue(draw(st.booleans()), kind)
    text = draw(st.one_of(st.text(max_size=12), st.sampled_from(("", "qwen3moe", "llama", "none", "yarn"))))
    raw = draw(st.one_of(st.just(text.encode()), st.binary(max_size=12)))  # bytes: not always UTF-8
    return GGUFValue(raw, kind)


@st.composite
def gguf_values(draw) -> GGUFValue:
    """Any metadata value: a scalar of any type, or an array of them (its item type the first item's)."""
    if draw(st.integers(0, 3)):
        return draw(scalar_values())
    kind = draw(st.sampled_from(KINDS))
    items = draw(st.lists(scalar_values(kind), min_size=1, max_size=4))
    return GGUFValue([v.value for v in items], ARR, kind)


TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_NL", "I8", "I32")


@st.composite
def reshaped(draw, rng_seed: int):
    """A tensor of another shape or type, its bytes consistent with them (values are not the point)."""
    dims = draw(st.lists(st.sampled_from((1, 2, 4, 31, 32, 33, 64, 256)), min_size=1, max_size=4))
    while len(dims) > 1 and math.prod(dims) > 2**16:  # a small file
        dims.pop(0)
    kind = draw(st.sampled_from(TYPES))
    rng = np.random.default_rng(rng_seed)
    if kind == "F32":
        return kind, rng.standard_normal(dims).astype(np.float32)
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if dims[-1] % block:
        dims[-1] = block * max(1, dims[-1] // block)
    raw = rng.integers(0, 256, size=(*dims[:-1], dims[-1] // block * size), dtype=np.uint8)
    return kind, raw


@fuzz(100)
@given(data=st.data(), kind=st.sampled_from(("F32", "Q8_0")))
def test_wrong_metadata_and_tensors_are_refused_by_name_or_import(work, data, kind):
    meta, weights = metadata(tokenizer=True), tensors(kind)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        what = data.draw(st.sampled_from(("set", "set", "set", "drop", "add", "tensor", "drop tensor")), label="edit")
        if what in ("set", "drop"):
            key = data.draw(st.sampled_from(sorted(meta)), label="key")
            if what == "drop":
                del meta[key]
            else:
                meta[key] = data.draw(gguf_values(), label="value")
        elif what == "add":
            key = data.draw(
                st.sampled_from(
                    (
                        f"{ARCH}.rope.scaling.type",
                        f"{ARCH}.nextn_predict_layers",
                        f"{ARCH}.expert_weights_norm",
                        f"{ARCH}.rope.scaling.factor",
                        "general.alignment",
                        "split.count",
                        "tokenizer.chat_template",
                        "tokenizer.ggml.padding_token_id",
                    )
                ),
                label="new key",
            )
            meta[key] = data.draw(gguf_values(), label="value")
        elif what == "tensor":
            name = data.draw(st.sampled_from(sorted(weights)), label="tensor")
            weights[name] = data.draw(reshaped(len(weights)), label="as")
        elif len(weights) > 1:
            del weights[data.draw(st.sampled_from(sorted(weights)), label="dropped")]
    folder = work / "meta"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    write(str(folder / "model.gguf"), meta, weights)
    check_import(str(folder), ["model.gguf"])
