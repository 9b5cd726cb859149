"""Saved calibrations: the last few per machine and setting, priced by their term-by-term median; other keys,
damaged files and old entries handled without losing what is good."""

import json
import time

import pytest

from weightstream.bench import calibration_store as store
from weightstream.sim.overlap_model import CostParams


def params(**terms) -> CostParams:
    base = dict(
        dense_s=0.1,
        dense_per_token_s=0.001,
        expert_call_s=0.005,
        expert_row_s=0.0001,
        read_latency_s=0.0002,
        read_s_per_mib=0.0005,
    )
    return CostParams(**{**base, **terms})


KEY = {"machine": {"host": "a"}, "settings": {"io_threads": 4}, "model": [("m.safetensors", 10, 1)]}
OTHER = {**KEY, "machine": {"host": "b"}}


def test_the_median_of_the_last_few_prices_and_other_keys_stay(tmp_path):
    path = tmp_path / "calibration.json"
    store.save(path, OTHER, params(dense_s=9.0), {}, {})
    for i, g in enumerate([0.9, 0.1, 0.2, 0.3, 0.25, 0.15, 0.12]):  # the first two fall out of a history of 5
        store.save(path, KEY, params(nonoverlap_s_per_mib=g, dense_s=0.1 + i / 100), {}, {"i": i})
    saved = store.load_saved(path, KEY)
    assert saved["samples"] == store.HISTORY == 5
    assert [e["extra"]["i"] for e in saved["entries"]] == [2, 3, 4, 5, 6]
    assert saved["params"]["nonoverlap_s_per_mib"] == pytest.approx(0.2)  # of 0.2 0.3 0.25 0.15 0.12
    assert saved["params"]["dense_s"] == pytest.approx(0.14)
    assert saved["spread"]["nonoverlap_s_per_mib"] == pytest.approx(0.3 / 0.12 - 1)
    assert saved["created"] == saved["entries"][-1]["created"]
    assert store.load_saved(path, OTHER)["params"]["dense_s"] == 9.0  # untouched by KEY's saves
    CostParams.from_dict(saved["params"])  # the median is a valid set of terms


def test_keep_one_forgets_the_earlier_ones(tmp_path):
    path = tmp_path / "calibration.json"
    store.save(path, KEY, params(dense_s=1.0), {}, {})
    store.save(path, KEY, params(dense_s=2.0), {}, {})
    store.save(path, KEY, params(dense_s=3.0), {}, {}, keep=1)
    saved = store.load_saved(path, KEY)
    assert saved["samples"] == 1 and saved["params"]["dense_s"] == 3.0


def test_missing_terms_and_the_readahead_spans(tmp_path):
    """A term some calibrations could not measure (no cgroup) is the median of those that did; the readahead's
    spans go element by element while they have one shape, and are the newest's where the shape changed."""
    path = tmp_path / "calibration.json"
    spans = [[[4096, 8192]], [[4096, 16384]], [[8192, 16384]]]
    for limit, ra in zip([None, 0.001, 0.003], spans):
        store.save(path, KEY, params(page_limit_s_per_mib=limit, page_readahead=ra), {}, {})
    saved = store.load_saved(path, KEY)["params"]
    assert saved["page_limit_s_per_mib"] == pytest.approx(0.002)
    assert saved["page_readahead"] == [[4096, 16384]]
    assert saved["page_cache_s_per_mib"] is None  # none measured it
    store.save(path, KEY, params(page_readahead=[[0, 0], [0, 4096]]), {}, {})
    assert store.load_saved(path, KEY)["params"]["page_readahead"] == [[0, 0], [0, 4096]]


def test_old_entries_are_dropped_and_a_damaged_file_is_replaced(tmp_path):
    path = tmp_path / "calibration.json"
    store.save(path, KEY, params(dense_s=1.0), {}, {})
    data = json.loads(path.read_text())
    data["entries"][0]["created"] = time.time() - store.MAX_AGE_S - 60
    path.write_text(json.dumps(data))
    store.save(path, KEY, params(dense_s=2.0), {}, {})
    saved = store.load_saved(path, KEY)
    assert saved["samples"] == 1 and saved["params"]["dense_s"] == 2.0
    path.write_text('{"entries": [{"key": ')  # cut short
    assert store.load_saved(path, KEY) is None
    store.save(path, KEY, params(dense_s=3.0), {}, {})
    assert store.load_saved(path, KEY)["params"]["dense_s"] == 3.0
    assert not path.with_suffix(".tmp").exists()


@pytest.mark.parametrize(
    "bad", [{"dense_s": float("nan")}, {"read_s_per_mib": -0.001}, {"dense_s": 0.0}, {"page_readahead": [[-1, 0]]}]
)
def test_an_entry_that_would_price_nonsense_is_not_priced_with_and_goes_at_the_next_save(tmp_path, bad):
    """A damaged or hand-edited entry (nan, a negative cost, a step of no dense seconds: infinite tok/s) is passed
    over as a damaged file is: the good entries price alone, and the next save drops it."""
    path = tmp_path / "calibration.json"
    store.save(path, KEY, params(dense_s=0.2), {}, {})
    store.save(path, KEY, params(**bad), {}, {})
    saved = store.load_saved(path, KEY)
    assert saved["samples"] == 1 and saved["params"]["dense_s"] == 0.2
    store.save(path, KEY, params(dense_s=0.4), {}, {})
    assert [e["params"]["dense_s"] for e in json.loads(path.read_text())["entries"]] == [0.2, 0.4]
    path.write_text(json.dumps({"entries": [json.loads(path.read_text())["entries"][0] | {"params": {"dense_s": 1}}]}))
    assert store.load_saved(path, KEY) is None  # terms missing: not a calibration
