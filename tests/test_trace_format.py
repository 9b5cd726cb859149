"""Trace format: builder, npz round trip, shapes, and clear errors for damaged or mismatched files."""

import json
import zipfile

import numpy as np
import pytest

from weightstream.errors import WeightstreamError
from weightstream.trace import ModelShape, TraceWriter, load, resolve_shape, save
from weightstream.trace.npz import ARRAYS

MIB = 2**20


def tiny_shape(**kw):
    base = {"name": "tiny", "layers": [1, 2, 3], "n_experts": 4, "top_k": 2, "expert_bytes": [1000] * 3}
    return ModelShape(**{**base, **kw})


def tiny_trace(weights=True):
    w = TraceWriter(tiny_shape())
    w.begin_step("a", "prefill")  # batched prefill of 2 tokens
    w.add(1, [0, 1], [0.6, 0.4] if weights else None)  # token 0
    w.add(1, [1, 2], [0.5, 0.5] if weights else None)  # token 1, same layer: same group
    w.add(2, [3, 0, 0, 1], [0.7, 0.3, 0.9, 0.1] if weights else None)
    w.begin_step("a", "decode")
    w.add(1, [2, 3], [0.5, 0.5] if weights else None)
    w.add(3, [0, 1], [0.5, 0.5] if weights else None)  # layer 2 absent: allowed
    w.begin_step("b", "decode", n_tokens=1)
    w.add(2, [1, 0], [0.8, 0.2] if weights else None)
    return w.finish()


def test_writer_builds_flat_arrays_in_replay_order():
    t = tiny_trace()
    assert t.requests == ["a", "b"]
    assert t.step_request.tolist() == [0, 0, 1]
    assert t.step_phase.tolist() == [0, 1, 1]
    assert t.step_tokens.tolist() == [2, 1, 1]  # inferred: longest layer list / top_k
    assert t.group_layer.tolist() == [1, 2, 1, 3, 2]
    assert t.step_groups.tolist() == [0, 2, 4, 5]
    assert t.experts.tolist() == [0, 1, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 1, 0]
    assert t.group_offsets.tolist() == [0, 4, 8, 10, 12, 14]
    assert t.n_tokens == 4 and t.n_accesses == 14
    assert t.key_index()[:4].tolist() == [0, 1, 1, 2]  # layer 1 is position 0
    assert t.key_index()[4] == 1 * 4 + 3


def test_round_trip_keeps_every_array(tmp_path):
    t = tiny_trace()
    save(t, tmp_path / "t.npz")
    back = load(tmp_path / "t.npz")
    assert back.shape == t.shape and back.requests == t.requests
    for name in ARRAYS:
        assert np.array_equal(getattr(back, name), getattr(t, name)), name
    assert np.allclose(back.weights, t.weights)
    no_weights = tiny_trace(weights=False)
    save(no_weights, tmp_path / "n.npz")
    assert load(tmp_path / "n.npz").weights is None


def test_slice_keeps_only_the_requests_it_covers():
    t = tiny_trace()
    tail = t.slice_steps(1, 3)
    assert tail.requests == ["a", "b"] and tail.step_request.tolist() == [0, 1]
    assert tail.experts.tolist() == t.experts[8:].tolist()
    only_b = t.slice_steps(2, 3)
    assert only_b.requests == ["b"] and only_b.step_request.tolist() == [0]
    only_b.validate()


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda w: w.add(1, [0, 1]), "before begin_step"),
        (lambda w: (w.begin_step("r", "decode"), w.add(5, [0, 1])), "not a routed layer"),
        (lambda w: (w.begin_step("r", "decode"), w.add(1, [0, 4])), "0..3"),
        (lambda w: (w.begin_step("r", "decode"), w.add(2, [0, 1]), w.add(1, [0, 1])), "must ascend"),
        (lambda w: w.begin_step("r", "generate"), "phase"),
        (lambda w: (w.begin_step("r", "decode"), w.add(1, [0, 1], [0.5])), "1 weights for 2 experts"),
        (lambda w: (w.begin_step("r", "decode"), w.begin_step("r", "decode")), "recorded no layer"),
    ],
)
def test_writer_rejects_bad_input(bad, message):
    with pytest.raises(WeightstreamError, match=message):
        bad(TraceWriter(tiny_shape()))


def test_empty_writer_is_an_error():
    with pytest.raises(WeightstreamError, match="no steps"):
        TraceWriter(tiny_shape()).finish()


def _rewrite(path, out, **changes):
    """Copy a trace file replacing some of its stored arrays (to fake damage the writer would refuse)."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update(changes)
    np.savez(out, **arrays)


def test_load_names_file_and_step_for_expert_beyond_shape(tmp_path):
    save(tiny_trace(), tmp_path / "t.npz")
    experts = np.array([0, 1, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 7, 0], np.int16)
    _rewrite(tmp_path / "t.npz", tmp_path / "bad.npz", experts=experts)
    with pytest.raises(WeightstreamError, match=r"bad\.npz: step 2 layer 2: expert 7 is outside 0\.\.3"):
        load(tmp_path / "bad.npz")


def test_load_names_file_and_step_for_layer_count_disagreement(tmp_path):
    save(tiny_trace(), tmp_path / "t.npz")
    _rewrite(tmp_path / "t.npz", tmp_path / "bad.npz", group_layer=np.array([1, 2, 1, 4, 2], np.int16))
    with pytest.raises(WeightstreamError, match=r"bad\.npz: step 1 lists layer 4.*only in layers 1\.\.3 \(3 layers\)"):
        load(tmp_path / "bad.npz")
    _rewrite(tmp_path / "t.npz", tmp_path / "order.npz", group_layer=np.array([2, 1, 1, 3, 2], np.int16))
    with pytest.raises(WeightstreamError, match=r"order\.npz: step 0 lists layer 1 after layer 2"):
        load(tmp_path / "order.npz")


def test_load_refuses_layer_groups_that_are_not_tokens_times_top_k(tmp_path):
    """Found at replay as a bare numpy reshape error before; now the file, step, layer and counts are named."""
    save(tiny_trace(), tmp_path / "t.npz")
    # move one choice from the prefill's layer-1 group (2 tokens x top-2 = 4) to its layer-2 group
    _rewrite(tmp_path / "t.npz", tmp_path / "bad.npz", group_offsets=np.array([0, 3, 8, 10, 12, 14], np.int64))
    with pytest.raises(
        WeightstreamError,
        match=r"bad\.npz: step 0 layer 1 lists 3 expert choices; its 2 token\(s\) "
        r"x top-2 of shape 'tiny' make 4",
    ):
        load(tmp_path / "bad.npz")
    _rewrite(tmp_path / "t.npz", tmp_path / "tokens.npz", step_tokens=np.array([2, 2, 1], np.int32))
    with pytest.raises(WeightstreamError, match=r"tokens\.npz: step 1 layer 1 lists 2 expert choices; its 2 token"):
        load(tmp_path / "tokens.npz")


def test_load_rejects_empty_truncated_and_foreign_files(tmp_path):
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(WeightstreamError, match=r"empty\.npz: empty file"):
        load(tmp_path / "empty.npz")
    save(tiny_trace(), tmp_path / "t.npz")
    data = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightstreamError, match=r"cut\.npz: not a readable trace.*truncated"):
        load(tmp_path / "cut.npz")
    np.savez(tmp_path / "foreign.npz", x=np.arange(3))
    with pytest.raises(WeightstreamError, match=r"foreign\.npz: no trace header"):
        load(tmp_path / "foreign.npz")
    with pytest.raises(WeightstreamError, match=r"missing\.npz: no such trace file"):
        load(tmp_path / "missing.npz")


def test_load_rejects_other_versions_and_damaged_offsets(tmp_path):
    save(tiny_trace(), tmp_path / "t.npz")
    with zipfile.ZipFile(tmp_path / "t.npz") as z:
        assert "header.npy" in z.namelist()
    header = {"format": "weightstream-trace", "version": 99, "shape": tiny_shape().to_dict(), "requests": ["a"]}
    _rewrite(tmp_path / "t.npz", tmp_path / "v.npz", header=np.frombuffer(json.dumps(header).encode(), np.uint8))
    with pytest.raises(WeightstreamError, match=r"v\.npz: trace version 99"):
        load(tmp_path / "v.npz")
    _rewrite(tmp_path / "t.npz", tmp_path / "o.npz", group_offsets=np.array([0, 4, 3, 10, 12, 14], np.int64))
    with pytest.raises(WeightstreamError, match=r"o\.npz: layer group offsets"):
        load(tmp_path / "o.npz")


def test_save_is_atomic_and_leaves_no_temporary(tmp_path):
    save(tiny_trace(), tmp_path / "t.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def test_named_shapes_match_the_published_expert_sizes():
    assert resolve_shape("mixtral-8x7b").expert_bytes[0] == 336 * MIB  # 3 x 4096 x 14336 x 2
    ds = resolve_shape("deepseek-v2-lite")
    assert ds.layers == list(range(1, 27)) and ds.expert_bytes[0] == 3 * 2048 * 1408 * 2
    assert ds.working_set_slots == 156
    qwen = resolve_shape("qwen3-30b-a3b")
    assert (len(qwen.layers), qwen.n_experts, qwen.top_k, qwen.expert_bytes[0]) == (48, 128, 8, 3 * 2048 * 768 * 2)
    olmoe = resolve_shape("olmoe-1b-7b")
    assert (len(olmoe.layers), olmoe.n_experts, olmoe.top_k) == (16, 64, 8)
    oss = resolve_shape("gpt-oss-20b")
    assert oss.expert_bytes[0] == (3 * 2880 * 2880 + 2 * 2880 + 2880) * 2 and oss.n_experts == 32


def test_config_json_shapes(tmp_path):
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps({"text_config": cfg}))
    shape = resolve_shape(str(tmp_path))
    assert shape.layers == [1] and shape.expert_bytes == [3 * 64 * 32 * 4]
    assert resolve_shape(str(tmp_path / "config.json"), expert_bytes=4096).expert_bytes == [4096]
    (tmp_path / "dense.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2}))
    with pytest.raises(WeightstreamError, match=r"dense\.json: no expert count"):
        resolve_shape(str(tmp_path / "dense.json"))
    with pytest.raises(WeightstreamError, match="neither a known name"):
        resolve_shape("mixtral-8x22b")
