"""Fuzzing the calibration store (bench/calibration_store.py): the calibrations `tune` saves beside the model
(`.weightstream/calibration.json`) and reads back, and the `weightstream bench --json` report `tune --cost-model`
reads.

A store holding good calibrations for a key (and another key's) is damaged as text and as JSON: entries, keys,
params, terms and `created` of any JSON value (NaN, infinities, negative and huge numbers, strings, nesting, the
readahead's spans of any shape), the whole file of another shape, text that is not UTF-8 or JSON no reader can
hold. A cost model file gets the same. The property: the store prices with terms a calibration could have
measured (each a finite number of 0 or more, dense_s and the page-cache spread above 0, the readahead spans pairs
of whole bytes) or is passed over as damaged (None: tune measures again), and a cost model is read as a line of
finite seconds or refused naming the file; never a traceback or a hang, and the files unchanged by reading them.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from weightstream.bench import calibration_store as store
from weightstream.errors import WeightstreamError
from weightstream.sim.overlap_model import CostParams, StepLoad, expert_cache_step_s, page_cache_step_s

from fuzz_support import assert_clear, digest, fuzz, json_text, json_values, outcome, time_limit

KEY = {"machine": {"host": "a", "cpu": "x"}, "settings": {"io_threads": 4}, "model": [["m.safetensors", 10, 1]]}
OTHER = {**KEY, "machine": {"host": "b"}}
TERMS = dict(
    dense_s=0.1,
    dense_per_token_s=0.001,
    expert_call_s=0.005,
    expert_row_s=0.0001,
    read_latency_s=0.0002,
    read_s_per_mib=0.0005,
    nonoverlap_s_per_mib=0.0001,
    page_cache_s_per_mib=0.002,
    page_cached_per_byte=1.3,
    page_limit_s_per_mib=0.003,
    page_readahead=[[4096, 8192], [0, 4096]],
)
FIELDS = {f.name: f for f in dataclasses.fields(CostParams)}


def good_store() -> dict:
    entries = [
        {"key": KEY, "params": {**TERMS, "dense_s": 0.1 + i / 100}, "measurements": {}, "extra": {}, "created": 1e9 + i}
        for i in range(3)
    ]
    return {"entries": [*entries, {"key": OTHER, "params": TERMS, "created": 5.0}]}


def near_numbers():
    return st.one_of(
        st.sampled_from((0, 0.0, -0.0, -1, 1, 1e-300, 1e300, 2**64, float("nan"), float("inf"), float("-inf"))),
        st.floats(),
        st.integers(-5, 5),
        st.booleans(),
        st.sampled_from(("0.1", "", None)),
    )


def spans():
    pair = st.lists(st.one_of(st.integers(-2, 2**40), near_numbers()), min_size=0, max_size=3)
    return st.one_of(st.lists(pair, max_size=3), st.lists(st.lists(pair, max_size=2), max_size=2), json_values())


def check_params(params: dict) -> None:
    """Terms a calibration could have measured, as `tune` prices with them (CostParams.from_dict)."""
    p = CostParams.from_dict(params)
    for name, f in FIELDS.items():
        value = getattr(p, name)
        if name == "page_readahead":
            assert value is None or (
                isinstance(value, list)
                and all(
                    isinstance(ra, list) and len(ra) == 2 and all(type(b) is int and b >= 0 for b in ra) for ra in value
                )
            ), value
            continue
        if value is None and "None" in str(f.type):
            continue
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
        assert math.isfinite(value) and value >= 0, (name, value)
    assert p.dense_s > 0 and p.page_cached_per_byte > 0, p  # every step pays dense_s; sim/tune.py divides by the other
    load = StepLoad(np.array([1, 4]), np.array([[2, 1], [3, 0]]), np.array([[1, 0], [2, 0]]), 2)
    priced = [expert_cache_step_s(p, load, 1.5)]
    if p.page_cache_s_per_mib is not None:  # measured: the page-cache model prices too
        priced.append(page_cache_step_s(p, load, 1.5))
    for seconds in priced:  # terms near a float's limit may price a step at infinity, never at NaN or below 0
        assert (seconds > 0).all(), seconds


@fuzz(150)
@given(data=st.data())
def test_any_saved_calibration_prices_with_sane_terms_or_is_passed_over(tmp_path_factory, data):
    saved = good_store()
    kind = data.draw(st.sampled_from(("terms", "terms", "entries", "whole", "text", "hostile")), label="damage")
    if kind == "terms":
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            entry = data.draw(st.sampled_from(saved["entries"][:3]), label="entry")
            params = entry["params"] = dict(entry["params"])
            name = data.draw(st.sampled_from([*FIELDS, "extra"]), label="term")
            value = data.draw(spans() if name == "page_readahead" else st.one_of(near_numbers(), json_values()))
            if data.draw(st.integers(0, 5), label="drop?") == 0:
                params.pop(name, None)
            else:
                params[name] = value
    elif kind == "entries":
        entries = saved["entries"]
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            i = data.draw(st.integers(0, len(entries) - 1), label="entry")
            field = data.draw(st.sampled_from(("key", "params", "created", "measurements", "whole")), label="field")
            value = data.draw(st.one_of(near_numbers(), json_values()), label="value")
            if field == "whole":
                entries[i] = value
            elif isinstance(entries[i], dict):
                entries[i] = {**entries[i], field: value}
    elif kind == "whole":
        saved = data.draw(st.one_of(json_values(), st.fixed_dictionaries({"entries": json_values()})), label="store")
    text = json_text(data, saved, kind)
    path = tmp_path_factory.getbasetemp() / "calibration.json"
    path.write_bytes(text)
    before = digest(path)
    with time_limit(f"load_saved({path})"):
        got = store.load_saved(path, KEY)
    assert digest(path) == before, "reading the store changed it"
    outcome("passed over" if got is None else "priced")  # --hypothesis-show-statistics counts them
    if got is not None:  # tune prices with the median of the entries' terms
        assert got["samples"] == len(got["entries"]) >= 1
        check_params(got["params"])
    # the next calibration's save replaces what it cannot read, and reads back
    with time_limit(f"save({path})"):
        store.save(path, KEY, CostParams.from_dict(TERMS), {}, {})
    again = store.load_saved(path, KEY)
    assert again is not None and again["samples"] >= 1
    check_params(again["params"])


@fuzz(100)
@given(data=st.data())
def test_any_cost_model_file_is_read_as_a_line_or_refused_by_name(tmp_path_factory, data):
    report = {"cost_model": {"fixed_s": 0.05, "per_mib_s": 0.002, "r2": 0.99, "points": 4}, "runs": []}
    kind = data.draw(st.sampled_from(("terms", "terms", "whole", "text", "hostile")), label="damage")
    if kind == "terms":
        model = report["cost_model"]
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            name = data.draw(st.sampled_from(("fixed_s", "per_mib_s", "r2", "points", "extra")), label="term")
            if data.draw(st.integers(0, 5), label="drop?") == 0:
                model.pop(name, None)
            else:
                model[name] = data.draw(st.one_of(near_numbers(), json_values()), label="value")
        if data.draw(st.booleans(), label="the cost model alone"):
            report = model
    elif kind == "whole":
        report = data.draw(json_values(), label="report")
    text = json_text(data, report, kind)
    path = tmp_path_factory.getbasetemp() / "bench.json"
    path.write_bytes(text)
    before = digest(path)
    try:
        with time_limit(f"read_cost_model({path})"):
            model = store.read_cost_model(str(path))
    except WeightstreamError as exc:
        outcome("refused")
        assert_clear(str(exc), f"--cost-model {path}")
    else:
        outcome("read")
        assert math.isfinite(model.fixed_s) and model.fixed_s > 0, model
        assert math.isfinite(model.per_mib_s) and model.per_mib_s >= 0, model
        assert type(model.points) is int, model
        assert math.isfinite(model.predict_s_per_token(3.0))
    assert digest(path) == before, "reading the report changed it"


def test_the_undamaged_store_prices(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(good_store()))
    got = store.load_saved(path, KEY)
    assert got["samples"] == 3 and got["params"]["dense_s"] == 0.11
    check_params(got["params"])
