"""Fuzzing the warm-restart state file (`MODEL/.weightstream/expert-cache-state.json`, cache/warm.py).

A state saved for a tiny model's expert files (its fingerprint right, so the fuzzed part is what is read after it)
is damaged as text and as JSON: fields and entries of any JSON value (floats, infinities, huge integers, strings,
nesting), entries of the wrong arity, keys no layer or expert has, the whole file of another shape, text that is
not UTF-8. The property is the module's promise: the state is read as a list of (layer, expert) keys with their
heat, which an expert cache warms from without an error, or it is said to be unreadable (one line on stderr) and
the start is cold; never a traceback or a hang, and the state file unchanged by reading it.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.cache import warm
from weightstream.cache.expert_cache import ExpertCache
from weightstream.store.model import map_model

from fuzz_support import Shown, digest, fuzz, interesting_ints, json_text, json_values, outcome, time_limit


@pytest.fixture(scope="module")
def mapped(tiny_model):
    return Shown(map_model(tiny_model("qwen3_moe")).layout, "the tiny qwen3_moe's expert layout")


def good_state(layout) -> dict:
    keys = sorted(layout.experts)
    return {
        "version": warm.VERSION,
        "fingerprint": warm.fingerprint(layout),
        "saved_at": 1.0,
        "experts": [[layer, expert, len(keys) - i] for i, (layer, expert) in enumerate(keys)],
    }


def entries(layout):
    """One entry of the experts list: a near miss of a real one, or any JSON."""
    layers = sorted({layer for layer, _ in layout.experts})
    ints = st.one_of(st.sampled_from(layers), st.integers(-3, 70), interesting_ints(64), st.sampled_from((2**70,)))
    floats = st.one_of(st.sampled_from((float("inf"), float("-inf"), float("nan"), 1.5, -0.0, 1e300)), st.floats())
    numbers = st.one_of(ints, floats, st.booleans(), st.sampled_from(("1", "x", "", None)))
    return st.one_of(
        st.tuples(ints, ints, ints).map(list),
        st.tuples(numbers, numbers, numbers).map(list),
        st.lists(numbers, max_size=5),
        json_values(),
    )


def unreadable_said(err: str, path: str) -> bool:
    lines = [line for line in err.splitlines() if line.strip()]
    return len(lines) == 1 and lines[0].startswith(f"weightstream: {path} ") and "starting cold" in lines[0]


@fuzz(150)
@given(data=st.data())
def test_any_saved_state_warms_the_cache_or_starts_cold(mapped, tmp_path_factory, capsys, data):
    layout = mapped.value
    state = good_state(layout)
    kind = data.draw(st.sampled_from(("entries", "entries", "fields", "whole", "text", "hostile")), label="damage")
    if kind == "entries":
        experts = state["experts"]
        for _ in range(data.draw(st.integers(1, 4), label="edits")):
            i = data.draw(st.integers(0, len(experts)), label="at")
            experts[i:i] = [data.draw(entries(layout), label="entry")]
            if data.draw(st.booleans(), label="replace"):
                del experts[i + 1 : i + 2]
    elif kind == "fields":
        key = data.draw(st.sampled_from(("experts", "saved_at", "extra", "version")), label="field")
        state[key] = data.draw(json_values(), label="value")
    elif kind == "whole":
        state = data.draw(json_values(), label="state")
    text = json_text(data, state, kind)
    folder = tmp_path_factory.getbasetemp() / "warm"
    folder.mkdir(exist_ok=True)
    path = str(folder / warm.STATE_FILE)
    with open(path, "wb") as f:
        f.write(text)
    warm._said.clear()  # each example's message is said (once a process otherwise)
    capsys.readouterr()
    before = digest(path)
    with time_limit(f"read_state({path})"):
        got = warm.read_state(path, layout)
    err = capsys.readouterr().err
    assert digest(path) == before, "reading the state changed it"
    outcome("cold" if got is None else "warmed")  # --hypothesis-show-statistics counts them
    if got is None:
        assert unreadable_said(err, path) or "saved for other expert files" in err, err
        return
    assert err == "", err
    keys, heat = got
    assert all(type(k) is tuple and len(k) == 2 and all(type(v) is int for v in k) for k in keys), keys
    assert all(k in heat and type(heat[k]) is int for k in keys), heat
    assert all(type(n) is int for n in heat.values())
    cache = ExpertCache(layout, 2 * layout.working_set_bytes, io_threads=1)  # as the engine's loader makes it
    try:
        with time_limit("ExpertCache.warm"):
            queued = cache.warm(keys, heat)
        assert 0 <= queued <= cache.n_slots and set(cache.slot_of) <= set(layout.experts)
        assert cache.stats.warm_issued == queued
    finally:
        cache.close()


def test_the_undamaged_state_is_read_whole(mapped, tmp_path):
    layout = mapped.value
    path = str(tmp_path / warm.STATE_FILE)
    state = good_state(layout)
    with open(path, "w") as f:
        json.dump(state, f)
    keys, heat = warm.read_state(path, layout)
    assert keys == [(e[0], e[1]) for e in state["experts"]] and heat[keys[0]] == len(keys)
