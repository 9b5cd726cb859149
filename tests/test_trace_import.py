"""Importers on the real traces (checked record by record against an independent read) and on damaged input."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from weightstream.errors import WeightstreamError
from weightstream.trace import load, resolve_shape
from weightstream.trace.importers import import_moe_beyond_csv, import_vllm_jsonl

from _real_traces import MIXTRAL_FILES, deepseek, deepseek_files, mixtral


def _choices(trace):
    """{(request name, token number in request, layer): experts} from a single-token-per-step trace."""
    out, seen = {}, {}
    for s in range(trace.n_steps):
        req = trace.requests[trace.step_request[s]]
        tok = seen[req] = seen.get(req, -1) + 1
        for g in range(trace.step_groups[s], trace.step_groups[s + 1]):
            a, b = trace.group_offsets[g], trace.group_offsets[g + 1]
            out[req, tok, int(trace.group_layer[g])] = trace.experts[a:b].tolist()
    return out


def test_mixtral_import_holds_every_record_in_decode_order():
    t = mixtral()
    records = []
    for path in MIXTRAL_FILES:
        records += [(path.name, json.loads(line)) for line in path.read_text().splitlines()]
    assert t.n_accesses == 2 * len(records) == 37336
    assert t.requests == [
        "humaneval_2_routing.jsonl:problem-0",
        "humaneval_2_routing.jsonl:problem-1",
        "gsm8k_2_routing.jsonl:problem-0",
        "gsm8k_2_routing.jsonl:problem-1",
    ]
    assert t.n_tokens == 83 + 255 + 168 + 79 and set(t.step_phase.tolist()) == {1}
    got = _choices(t)
    for name, r in records:
        assert got[f"{name}:problem-{r['problem_id']}", r["token_idx"], r["layer"]] == r["experts"]
    assert np.allclose(t.weights[:2], records[0][1]["gating_probs"])


def test_deepseek_import_is_token_major_per_prompt():
    files = deepseek_files()[:12]
    t = deepseek(12)
    expected = {}
    for path in files:
        rows = list(csv.reader(path.open(newline="", encoding="utf-8")))[1:]
        per_layer = {}
        for layer, _, _, experts in rows:
            per_layer.setdefault(int(layer), []).append(json.loads(experts))
        for layer, tokens in per_layer.items():
            for i, e in enumerate(tokens):
                expected[path.name, i, layer] = e
    assert _choices(t) == expected
    assert t.requests == [p.name for p in files] and set(t.step_phase.tolist()) == {0}
    assert t.group_layer[:26].tolist() == list(range(1, 27))  # first token, every layer ascending


def test_full_deepseek_import_has_every_row():
    t = deepseek()
    assert len(t.requests) == 399 and t.n_tokens == 33806 and t.n_accesses == 33806 * 26 * 6


def _jsonl(tmp_path, lines, name="r.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


REC = {"dataset": "x", "problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.6, 0.4], "token_idx": 0}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(REC), json.dumps(REC)[:40]], r"r\.jsonl:2: not a JSON object.*truncated"),
        (
            [json.dumps(REC), json.dumps({**REC, "token_idx": 1, "experts": [1, 8]})],
            r"r\.jsonl:2: expert 8 is outside 0\.\.7",
        ),
        ([json.dumps({**REC, "layer": 32})], r"r\.jsonl:1: layer 32 is not a routed layer.*0\.\.31"),
        ([json.dumps({**REC, "experts": [1, 2, 3]})], r"r\.jsonl:1: 3 experts chosen.*top-k 2"),
        ([json.dumps(REC), json.dumps(REC)], r"r\.jsonl:2: problem 0 token 0 layer 0 already given on line 1"),
        ([json.dumps({"layer": 0})], r"r\.jsonl:1: record lacks one of"),
        ([], r"r\.jsonl: no routing records \(empty file\)"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, lines, message):
    with pytest.raises(WeightstreamError, match=message):
        import_vllm_jsonl([_jsonl(tmp_path, lines)], resolve_shape("mixtral-8x7b"))


def _csv(tmp_path, rows, header="Layer ID,Batch Number,Token,Activated Expert IDs"):
    path = tmp_path / "p.csv"
    path.write_text("\n".join([header] + rows) + "\n" if header else "")
    return path


GOOD = [f'{layer},0,tok{t},"[{t}, 1, 2, 3, 4, 5]"' for layer in range(1, 27) for t in range(2)]


@pytest.mark.parametrize(
    "rows, header, message",
    [
        (GOOD[:-1], None, r"p\.csv: batch 0: layer 26 has 1 tokens but layer 1 has 2; the file is truncated"),
        (GOOD[:3] + ['2,0,x,"[1, 2, 3, 4, 5, 64]"'] + GOOD[4:], None, r"p\.csv:5: expert 64 is outside 0\.\.63"),
        (['27,0,x,"[0, 1, 2, 3, 4, 5]"'], None, r"p\.csv:2: layer 27 is not a routed layer.*1\.\.26"),
        (['1,0,x,"[0, 1, 2]"'], None, r"p\.csv:2: 3 experts chosen.*top-k 6"),
        (['1,0,x,"[0, 1, 2, 3, 4, five]"'], None, r"p\.csv:2: expert list .* non-integer"),
        (["1,0,x"], None, r"p\.csv:2: 3 fields, expected 4"),
        ([], "Layer,Batch,Token,Experts", r"p\.csv:1: header"),
        ([], None, r"p\.csv: header but no rows"),
        ([], "", r"p\.csv: empty file"),
    ],
)
def test_bad_csv_names_file_and_line(tmp_path, rows, header, message):
    kwargs = {} if header is None else {"header": header}
    with pytest.raises(WeightstreamError, match=message):
        import_moe_beyond_csv([_csv(tmp_path, rows, **kwargs)], resolve_shape("deepseek-v2-lite"))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, check=False
    )


def test_cli_import_writes_a_loadable_trace_and_reports_bad_input(tmp_path):
    out = tmp_path / "ds.npz"
    files = [str(p) for p in deepseek_files()[:3]]
    res = _cli(
        "trace", "import", *files, "--format", "moe-beyond-csv", "--model-shape", "deepseek-v2-lite", "-o", str(out)
    )
    assert res.returncode == 0, res.stderr
    assert load(out).requests == [p.split("/")[-1] for p in files]
    info = json.loads(_cli("trace", "info", str(out), "--json").stdout)
    assert info["requests"] == 3 and info["working_set_slots"] == 156
    res = _cli(
        "trace",
        "import",
        files[0],
        "--format",
        "vllm-jsonl",
        "--model-shape",
        "deepseek-v2-lite",
        "-o",
        str(tmp_path / "x.npz"),
    )
    assert res.returncode == 2 and f"{files[0]}:1: not a JSON object" in res.stderr
    assert not (tmp_path / "x.npz").exists()


def test_prompt_files_text_and_jsonl(tmp_path):
    from weightstream.bench.prompts import read_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n\n{"prompt": "World"}\n')
    assert read_prompts(str(prompts)) == ["Hello", "World"]
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo {not json}\n")
    assert read_prompts(str(text)) == ["one", "two {not json}"]
    prompts.write_text("\n")
    with pytest.raises(WeightstreamError, match="no prompts"):
        read_prompts(str(prompts))
    prompts.write_text('{"text": "x"}\n')
    with pytest.raises(WeightstreamError, match=r"p\.jsonl:1: expected a JSON object with a 'prompt' field"):
        read_prompts(str(prompts))


def test_cli_record_with_the_engine_then_simulate(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cache holds experts\nRouting decides which\n")
    out = tmp_path / "rec.npz"
    res = _cli(
        "trace", "record", tiny_model("qwen3_moe"), "--prompts", str(prompts), "--max-new-tokens", "4", "-o", str(out)
    )
    assert res.returncode == 0, res.stderr
    t = load(out)
    assert t.requests == ["prompt-0", "prompt-1"]
    for r in (0, 1):  # one batched prefill step, then one decode step per further token
        phases = t.step_phase[t.step_request == r].tolist()
        assert phases[0] == 0 and set(phases[1:]) == {1} and len(phases) >= 2
        assert t.step_tokens[t.step_request == r][0] > 1
    sim = _cli("simulate", str(out), "--json", "--train-share", "0", "--sizes", "1x,2x")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["accesses"] == t.n_accesses
