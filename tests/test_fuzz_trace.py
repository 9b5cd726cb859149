"""Fuzzing the routing-trace formats: weightstream's own .npz (read by `trace info`, `simulate`, `tune`, serve's
--routing-trace), and the dumps `weightstream trace import` reads: moe-beyond CSV and vLLM's JSON lines.

Valid files of a tiny shape (2 routed layers, 4 experts, top-2) are damaged as bytes, and rewritten with fields of
any JSON or text (numbers out of range, floats, huge integers, unicode, NUL, nesting), rows and keys missing or
extra; a trace file gets arrays of other dtypes, shapes and values and a header of any JSON. Each goes through the
commands as a user runs them (the CLI's `main`, in this process). The property: exit 0 with a trace every reader
takes (loaded again, replayed token by token, simulated), or exit 2 with one line naming the file; never a
traceback or a hang, and the input unchanged.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import csv
import io
import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.trace import load
from weightstream.trace.npz import ARRAYS, FORMAT, VERSION
from weightstream.trace.remap import token_rows

from cli_support import assert_one_line_error, ran_in_process
from fuzz_support import digest, fuzz, hostile_json, interesting_ints, json_values, mutated, outcome, time_limit

CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 2,
    "hidden_size": 8,
    "moe_intermediate_size": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
CSV_HEADER = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]
CSV_ROWS = [[str(layer), "0", f"tok{t}", f"[{t % 4}, {(t + 1) % 4}]"] for layer in (0, 1) for t in range(3)]
CSV_ROWS += [[str(layer), "1", "x", "[3, 2]"] for layer in (0, 1)]
JSONL = [
    {"problem_id": p, "token_idx": t, "layer": layer, "experts": [t % 4, (t + 2) % 4], "gating_probs": [0.7, 0.3]}
    for p in (0, 1)
    for t in range(2)
    for layer in (0, 1)
]
# text a field of a dump may hold instead of its number or list
FIELD_TEXT = st.one_of(
    st.sampled_from(("", "0", "1", "-1", "4", "1.5", "1e3", "nan", "inf", "0x1", "+1", " 1 ", "١", "9" * 30)),
    st.sampled_from(("[]", "[0]", "[0, 1]", "[0,1,2]", "[1, 1]", "[-1, 0]", "[0, 4]", "[0,, 1]", "[[0], [1]]")),
    st.sampled_from(("[0, 1", "0, 1]", "[a, b]", "[1.0, 2.0]", "[" + "9" * 5000 + ", 0]", '"', "\x00", "é", "\r")),
    st.text(max_size=12),
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def csv_text(header, rows) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue().encode()


def check_trace(path: str) -> None:
    """A trace every reader takes: `trace info`, the engine's token-by-token replay, `simulate`."""
    with time_limit(f"reading the trace {path}"):
        code, out, err = ran_in_process("trace", "info", path, "--json")
        assert code == 0 and "Traceback" not in err, err
        info = json.loads(out)
        trace = load(path)
        rows = token_rows(trace)
        assert rows.shape == (trace.n_tokens, len(trace.shape.layers), trace.shape.top_k)
        assert info["tokens"] == trace.n_tokens and info["accesses"] == trace.n_accesses
        if trace.n_steps:
            args = ("--policies", "lru,belady", "--sizes", "1x,2x", "--train-share", "0", "--json")
            code, out, err = ran_in_process("simulate", path, *args)
            assert code == 0 and "Traceback" not in err, err
            assert json.loads(out)


def check_import(folder, files: list[str], fmt: str) -> None:
    """`trace import`: a trace every reader takes, or one line naming the file at fault; the inputs unchanged."""
    paths = [str(folder / f) for f in files]
    before = [digest(p) for p in paths]
    out = str(folder / "out.npz")
    if os.path.exists(out):
        os.unlink(out)
    args = ("--format", fmt, "--model-shape", folder / "config.json", "-o", out)
    with time_limit(f"weightstream trace import {paths}"):
        code, stdout, err = ran_in_process("trace", "import", *paths, *args)
    assert [digest(p) for p in paths] == before, "the import changed its input"
    outcome("imported" if code == 0 else "refused")  # --hypothesis-show-statistics counts them
    if code == 0:
        assert stdout.startswith(f"{out}: "), (stdout, err)
        check_trace(out)
    else:
        assert_one_line_error(code, err, "trace")
        assert any(p in err for p in paths), err
        assert not os.path.exists(out), err


# ------------------------------------------------------------------------------------------------ moe-beyond CSV


@fuzz(100)
@given(data=st.data())
def test_any_moe_beyond_csv_is_refused_by_name_or_imported(folder, data):
    header, rows = list(CSV_HEADER), [list(r) for r in CSV_ROWS]
    kind = data.draw(st.sampled_from(("fields", "fields", "rows", "bytes")), label="damage")
    if kind == "fields":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            row = data.draw(st.sampled_from(rows), label="row")
            row[data.draw(st.integers(0, 3), label="field")] = data.draw(FIELD_TEXT, label="text")
    elif kind == "rows":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            edit = data.draw(st.sampled_from(("drop", "repeat", "short", "long", "header")), label="edit")
            i = data.draw(st.integers(0, len(rows) - 1), label="row")
            if edit == "drop" and len(rows) > 1:
                del rows[i]
            elif edit == "repeat":
                rows.insert(i, list(rows[i]))
            elif edit == "short":
                rows[i] = rows[i][: data.draw(st.integers(0, 3))]
            elif edit == "long":
                rows[i] = rows[i] + ["extra"]
            else:
                header[data.draw(st.integers(0, 3))] = data.draw(FIELD_TEXT, label="header")
    text = csv_text(header, rows)
    if kind == "bytes":
        text = data.draw(mutated(text), label="bytes")
    if data.draw(st.booleans(), label="spreadsheet"):  # a byte-order mark and CRLF line ends
        text = b"\xef\xbb\xbf" + text.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    (folder / "dump.csv").write_bytes(text)
    check_import(folder, ["dump.csv"], "moe-beyond-csv")


# ------------------------------------------------------------------------------------------------- vLLM JSON lines


@fuzz(100)
@given(data=st.data())
def test_any_vllm_jsonl_is_refused_by_name_or_imported(folder, data):
    records = [dict(r) for r in JSONL]
    kind = data.draw(st.sampled_from(("values", "values", "keys", "lines", "bytes")), label="damage")
    lines = None
    if kind == "values":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            record = data.draw(st.sampled_from(records), label="record")
            key = data.draw(st.sampled_from([*JSONL[0], "extra"]), label="key")
            near = st.one_of(
                interesting_ints(64),
                st.integers(-5, 5),
                st.lists(st.integers(-2, 6), max_size=4),
                st.lists(st.floats(), max_size=3),
            )
            record[key] = data.draw(st.one_of(near, json_values()), label="value")
    elif kind == "keys":
        record = data.draw(st.sampled_from(records), label="record")
        record.pop(data.draw(st.sampled_from(sorted(record)), label="dropped"))
    if kind == "lines":
        lines = [json.dumps(r) for r in records]
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            i = data.draw(st.integers(0, len(lines) - 1), label="line")
            lines[i] = data.draw(
                st.one_of(
                    st.sampled_from(("", " ", "{", "[]", "null", "1", '"x"', "{}", "NaN", '{"a": 1} {"b": 2}')),
                    hostile_json().map(lambda b: b.decode("utf-8", "replace").replace("\n", " ")),
                    json_values().map(json.dumps),
                    st.just(lines[i][: len(lines[i]) // 2]),
                ),
                label="text",
            )
    text = "\n".join(lines or [json.dumps(r) for r in records]).encode()
    if kind == "bytes":
        text = data.draw(mutated(text), label="bytes")
    (folder / "dump.jsonl").write_bytes(text)
    check_import(folder, ["dump.jsonl"], "vllm-jsonl")


# ---------------------------------------------------------------------------------------------- weightstream .npz


@pytest.fixture(scope="module")
def good_npz(folder) -> str:
    (folder / "good.csv").write_bytes(csv_text(CSV_HEADER, CSV_ROWS))
    out = folder / "good.npz"
    args = ("--format", "moe-beyond-csv", "--model-shape", folder / "config.json", "-o", out)
    code, _, err = ran_in_process("trace", "import", folder / "good.csv", *args)
    assert code == 0, err
    return str(out)


def array_values(name: str, like: np.ndarray):
    """Another array for `name`: other dtypes, shapes and values than `like` has."""
    like = like.reshape(-1) if like.dtype.kind in "iufb" else np.zeros(like.size, np.int64)  # an earlier edit's
    n = len(like)
    ints = st.one_of(st.integers(-3, 8), interesting_ints(64).map(lambda v: v - 2**63 if v >= 2**63 else v))
    return st.one_of(
        st.lists(ints, min_size=0, max_size=n + 2).map(lambda v: np.array(v, dtype=np.int64)),
        st.sampled_from(("int8", "uint8", "int16", "int32", "int64", "uint64", "float32", "float64", "bool")).map(
            lambda dt: like.astype(dt)
        ),
        st.just(like.reshape(1, -1)),
        st.just(like[:0]),
        st.just(np.array(7)),
        st.lists(st.floats(), min_size=1, max_size=max(n, 1)).map(lambda v: np.array(v)),
        st.just(np.array(["a"] * max(n, 1))),
        st.just(np.zeros(n, dtype=np.complex64)),
        st.just(np.array([{"a": 1}] * max(n, 1), dtype=object)),
        st.just(np.zeros(n, dtype=[("a", "i4")])),
        st.builds(lambda i, v: _with(like, i, v), st.integers(0, max(n - 1, 0)), ints),
    )


def _with(like: np.ndarray, i: int, v: int) -> np.ndarray:
    out = like.astype(np.int64).copy()
    if len(out):
        out[i] = v
    return out


def header_values(header: dict):
    keys = st.sampled_from(["format", "version", "shape", "requests", "extra"])
    shape_keys = st.sampled_from(["name", "layers", "n_experts", "top_k", "expert_bytes", "extra"])
    near = st.one_of(st.integers(-2, 5), interesting_ints(64), st.lists(st.integers(-2, 5), max_size=4))
    return st.one_of(
        st.tuples(st.just("header"), keys, st.one_of(json_values(), near)),
        st.tuples(st.just("shape"), shape_keys, st.one_of(json_values(), near)),
        st.tuples(st.just("whole"), st.none(), json_values()),
    )


@fuzz(100)
@given(data=st.data())
def test_any_trace_file_is_refused_by_name_or_read(folder, good_npz, data):
    with np.load(good_npz) as f:
        arrays = {k: f[k] for k in f.files}
    header = json.loads(bytes(arrays.pop("header")).decode())
    kind = data.draw(st.sampled_from(("arrays", "arrays", "header", "header text", "bytes")), label="damage")
    raw = None
    if kind == "arrays":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            name = data.draw(st.sampled_from([*ARRAYS, "weights"]), label="array")
            if data.draw(st.integers(0, 4), label="drop?") == 0:
                arrays.pop(name, None)
            else:
                like = arrays.get(name, np.ones(np.size(arrays.get("experts", ())), np.float32))
                arrays[name] = data.draw(array_values(name, like), label="as")
    elif kind == "header":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            where, key, value = data.draw(header_values(header), label="edit")
            if where == "whole":
                header = value
            elif where == "header" and isinstance(header, dict):
                header[key] = value
            elif isinstance(header, dict) and isinstance(header.get("shape"), dict):
                header["shape"][key] = value
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    elif kind == "header text":
        arrays["header"] = np.frombuffer(data.draw(hostile_json(), label="header text"), dtype=np.uint8)
    else:
        with open(good_npz, "rb") as f:
            raw = data.draw(mutated(f.read()), label="bytes")
    path = str(folder / "case.npz")
    if raw is not None:
        with open(path, "wb") as f:
            f.write(raw)
    else:
        arrays.setdefault("header", np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    before = digest(path)
    with time_limit(f"weightstream trace info {path}"):
        code, out, err = ran_in_process("trace", "info", path, "--json")
    outcome("read" if code == 0 else "refused")  # --hypothesis-show-statistics counts them
    if code == 0:
        check_trace(path)
    else:
        assert_one_line_error(code, err, "trace", path)
    assert digest(path) == before, "reading the trace changed it"


def test_the_undamaged_inputs_import(folder, good_npz):
    """Where the fuzzers start: dumps that import and a trace that every reader takes."""
    (folder / "dump.csv").write_bytes(csv_text(CSV_HEADER, CSV_ROWS))
    (folder / "dump.jsonl").write_text("\n".join(json.dumps(r) for r in JSONL))
    for file, fmt in (("dump.csv", "moe-beyond-csv"), ("dump.jsonl", "vllm-jsonl")):
        check_import(folder, [file], fmt)
        assert os.path.exists(folder / "out.npz")
    check_trace(good_npz)
    assert FORMAT == "weightstream-trace" and VERSION == 1  # what the header edits start from
