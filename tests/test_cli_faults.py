"""Bad input from issue 52, each through the shipped entry point (the CLI's `main`, or HTTP for serve): a one-line
error naming the input, or the right behaviour, and never a traceback."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from weightstream.trace import load, resolve_shape, save
from weightstream.trace.format import Trace

from cli_support import assert_one_line_error as one_line_error
from cli_support import ran_in_process, refused_in_process
from serve_support import ServerProcess

GOOD_CSV_ROWS = [f'{layer},0,tok{t},"[{t}, 1, 2, 3, 4, 5]"' for layer in range(1, 27) for t in range(2)]
CSV_HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs"


def assert_one_line_error(code: int, err: str, command: str, *words: str) -> None:
    """`cli_support.assert_one_line_error`, and nothing else on stderr."""
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    one_line_error(code, err, command, *words)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if the command goes on to load a model or serve: what it refuses, it refuses before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command loaded a model or served before refusing its input")

    monkeypatch.setattr("weightstream.engine.loader.load_streaming_model", refuse)
    monkeypatch.setattr("weightstream.serve.server.serve", refuse)


def test_warm_restart_state_of_another_json_shape_starts_cold(tiny_model, tmp_path):
    """Case 2: `[]` or `null` in the saved state is reported as unreadable and the run goes on cold."""
    model = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m")
    state = model / ".weightstream" / "expert-cache-state.json"
    state.parent.mkdir(exist_ok=True)  # the shared model may hold a state an earlier test saved
    for text in ("[]", "null"):
        state.write_text(text)
        code, out, err = ran_in_process(
            "generate", model, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--warm-restart", "--io-threads", "2"
        )
        assert code == 0 and "Traceback" not in err, err
        assert f"{state} is unreadable (it holds {text}, not a JSON object); starting cold" in err, err
        assert "tok/s" in err  # it generated
        assert isinstance(json.loads(state.read_text()), dict)  # the run saved its own state over the damaged one


def test_an_empty_prompt_is_refused(tiny_model, nothing_loads):
    """Case 3: `--prompt ""` is refused as `--prompt-ids ""` is, not a ValueError from max()."""
    code, err = refused_in_process("generate", tiny_model("qwen3_moe"), "--prompt", "")
    assert_one_line_error(code, err, "generate", "--prompt ''", "no tokens", "non-empty prompt")


def test_a_moe_beyond_csv_that_is_not_utf8_is_refused_by_name(tmp_path):
    """Case 4: 300 random bytes given as a moe-beyond CSV: the file named, not a UnicodeDecodeError."""
    path = tmp_path / "noise.csv"
    path.write_bytes(b"\xff" + random.Random(52).randbytes(299))
    out = tmp_path / "t.npz"
    code, err = refused_in_process(
        "trace", "import", path, "--format", "moe-beyond-csv", "--model-shape", "deepseek-v2-lite", "-o", out
    )
    assert_one_line_error(code, err, "trace", f"{path}: not a UTF-8 CSV", "0xff", "moe-beyond CSV")
    assert not out.exists()


def test_a_generation_past_the_models_positions_is_refused_before_loading(tiny_model, nothing_loads):
    """Case 5: prompt + --max-new-tokens past max_position_embeddings (512) is refused, naming the numbers."""
    model = tiny_model("qwen3_moe")
    code, err = refused_in_process("generate", model, "--prompt-ids", "1,2", "--max-new-tokens", "10000")
    words = ("--max-new-tokens 10000", "2-token prompt", "10002 positions", "512", "ask for at most 510")
    assert_one_line_error(code, err, "generate", *words)
    code, err = refused_in_process("generate", model, "--prompt-ids", ",".join(["1"] * 512))
    assert_one_line_error(code, err, "generate", "512 tokens", "512 positions", "shorten the prompt")


def test_tune_refuses_more_memory_than_the_machine_as_generate_does(tiny_model, nothing_loads):
    """Case 6: `tune --memory 10TiB` on a smaller machine gets generate's refusal; both before any work (generate
    refused it once the model had loaded)."""
    model = tiny_model("qwen3_moe")
    words = ("--memory 10.0 TiB: more than this machine's", "of RAM; give at most")
    code, err = refused_in_process("tune", model, "--memory", "10TiB")
    assert_one_line_error(code, err, "tune", *words)
    code, err = refused_in_process("generate", model, "--prompt-ids", "1", "--memory", "10TiB")
    assert_one_line_error(code, err, "generate", *words)


def test_simulating_a_trace_without_steps_is_refused(tmp_path):
    """Case 7: a valid trace with no steps is an error, not a table of zeros."""
    none32, none64 = np.zeros(0, np.int32), np.zeros(1, np.int64)
    empty = Trace(
        resolve_shape("deepseek-v2-lite"), ["r0"], none32, np.zeros(0, np.uint8), none32, none64, none32, none64, none32
    )
    path = tmp_path / "empty.npz"
    save(empty, path)
    assert load(path).n_steps == 0  # a trace file every reader accepts
    for extra in ((), ("--train-share", "0")):
        code, err = refused_in_process("simulate", path, *extra)
        assert_one_line_error(code, err, "simulate", f"{path}: the trace has no steps")


def test_a_directory_without_config_is_named_before_the_tokenizer(tmp_path, nothing_loads):
    """Case 8: `--prompt` on an empty directory says what `--prompt-ids` says (no config.json), not 'no tokenizer'."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = refused_in_process("generate", empty, "--prompt", "hi")
    assert_one_line_error(code, err, "generate", f"{empty}/config.json: missing config.json")
    assert "tokenizer" not in err
    assert refused_in_process("generate", empty, "--prompt-ids", "1") == (code, err)


def test_serve_refuses_a_bad_expert_cache_before_binding_or_loading(tiny_model, nothing_loads):
    """Case 9: `serve --expert-cache abc` is refused before a port is bound or the model loads."""
    code, err = refused_in_process("serve", tiny_model("qwen3_moe"), "--port", "0", "--expert-cache", "abc")
    assert_one_line_error(code, err, "serve", "--expert-cache 'abc': not a size", "1.5x")
    assert "listening" not in err and "stopped" not in err


def test_a_spreadsheet_csv_with_a_byte_order_mark_and_crlf_imports(tmp_path):
    """Case 10: a UTF-8 BOM and CRLF line ends (as spreadsheets export) import as the plain file does."""
    plain, sheet = tmp_path / "plain", tmp_path / "sheet"
    plain.mkdir()
    sheet.mkdir()
    lines = [CSV_HEADER, *GOOD_CSV_ROWS]
    (plain / "p.csv").write_bytes(("\n".join(lines) + "\n").encode())
    (sheet / "p.csv").write_bytes(b"\xef\xbb\xbf" + ("\r\n".join(lines) + "\r\n").encode())
    traces = []
    for where in (plain, sheet):
        args = ("--format", "moe-beyond-csv", "--model-shape", "deepseek-v2-lite", "-o", where / "t.npz")
        code, out, err = ran_in_process("trace", "import", where / "p.csv", *args)
        assert code == 0 and "Traceback" not in err, err
        assert "1 requests, 2 tokens" in out
        traces.append(load(where / "t.npz"))
    assert traces[0].requests == traces[1].requests == ["p.csv"]
    assert np.array_equal(traces[0].experts, traces[1].experts)
    assert np.array_equal(traces[0].group_layer, traces[1].group_layer)


def test_a_negative_expert_cache_gets_the_size_error(tiny_model, nothing_loads):
    """Case 12: `--expert-cache -2x` and `--expert-cache=-2x` both get weightstream's size error, not argparse's
    "expected one argument"."""
    model = tiny_model("qwen3_moe")
    for given in (("--expert-cache", "-2x"), ("--expert-cache=-2x",)):
        code, err = refused_in_process("generate", model, "--prompt-ids", "1", *given)
        assert_one_line_error(code, err, "generate", "--expert-cache '-2x': not a size")


def test_serve_refuses_booleans_where_numbers_belong(tiny_model):
    """Case 12: `"max_tokens": true` is a 400 that names the field, not a one-token completion."""
    server = ServerProcess(tiny_model("qwen3_moe"), "--expert-cache", "2x", "--io-threads", "2")
    try:
        server.wait_ready()
        completion = {"model": "model", "prompt": "Hi", "temperature": 0}
        chat = {"model": "model", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
        cases = [
            ("/v1/completions", {**completion, "max_tokens": True}, "max_tokens", "true"),
            ("/v1/completions", {**completion, "max_tokens": False}, "max_tokens", "false"),
            ("/v1/completions", {**completion, "max_tokens": 2, "n": True}, "n", "true"),
            ("/v1/chat/completions", {**chat, "max_completion_tokens": True}, "max_completion_tokens", "true"),
            ("/v1/chat/completions", {**chat, "max_tokens": 2, "temperature": True}, "temperature", "true"),
        ]
        for path, body, param, value in cases:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
            assert error["message"] == f"{param}: {value} is a boolean, not a number; send a number", error
        ok = httpx.post(f"{server.url}/v1/completions", json={**completion, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
        assert "Traceback" not in server.stderr
    finally:
        server.kill()


def test_a_small_models_summary_says_its_sizes_in_units_that_scale_down(tiny_model):
    """Case 11: the run's summary line gave a tiny model's cache and working set as "0 MiB"."""
    code, out, err = ran_in_process("generate", tiny_model("qwen3_moe"), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 0, err
    summary = next(line for line in err.splitlines() if line.startswith("prefill "))
    assert " 0 MiB" not in summary and " 0.0 MiB" not in summary, summary
    assert "KiB" in summary, summary  # the tiny model's experts are a few KiB each


def _leases_held(pid: int, path) -> bool:
    """Whether process `pid` holds a lease on `path` now (/proc/locks: "LEASE ... READ PID MAJ:MIN:INODE")."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any(
            line.split()[1] == "LEASE" and line.split()[4] == str(pid) and line.split()[5].endswith(f":{inode}")
            for line in f
        )


def _truncate_elsewhere(path, size: int) -> subprocess.CompletedProcess:
    """truncate(2) of `path` by another process, blocking as a writer does until the lease holder lets go."""
    code = f"import os; os.truncate({str(path)!r}, {size})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def _dense_shard(model_dir) -> str:
    """The shard holding the model's embedding: dense weights the model reads through a mapping."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return str(model_dir / index[next(k for k in index if "embed_tokens" in k)])


def test_a_shard_truncated_under_serve_is_an_error_naming_it_and_serve_lives_on(tiny_model, tmp_path):
    """Case 1: `serve`, a completion, its tokenizer, index and config truncated (read whole at load) and a weight file
    renamed over and another deleted (the bytes loaded are kept): the same answer. Then a weight file truncated (GNU
    truncate as the issue ran it, then a blocking truncate(2)): no SIGBUS; the next completion answers 500 naming the
    file, /health still answers, and SIGTERM still ends the server cleanly. The writer was held until the model
    stopped reading (engine/file_guard.py)."""
    model = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m")
    shard = _dense_shard(model)
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    server = ServerProcess(str(model), "--expert-cache", "1x")
    try:
        server.wait_ready()
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        assert _leases_held(server.pid, shard)
        for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json", "config.json"):
            os.truncate(model / name, 0)  # read whole at load: the model needs none of them again
        replaced, deleted = sorted(str(p) for p in model.glob("model-*.safetensors") if str(p) != shard)[:2]
        spare = tmp_path / "spare"
        shutil.copy(replaced, spare)
        with open(spare, "r+b") as f:  # every tensor's bytes other in the replacement: a reread answers otherwise
            start = 8 + int.from_bytes(f.read(8), "little")
            f.seek(start)
            f.write(os.urandom(os.path.getsize(spare) - start))
        os.rename(spare, replaced)  # renamed over, and deleted: the server keeps the bytes it loaded
        os.unlink(deleted)
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"] == first.json()["choices"], again.text
        gnu = subprocess.run(["truncate", "-s", "1000", shard], capture_output=True, text=True)
        # GNU truncate opens without blocking: the lease's notice makes it fail once (EAGAIN) or it went through
        assert gnu.returncode == 0 or "temporarily unavailable" in gnu.stderr, gnu.stderr
        assert _truncate_elsewhere(shard, 1000).returncode == 0
        assert os.path.getsize(shard) == 1000
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and shard in r.json()["error"]["message"], r.text
        assert "truncated" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert server.signal(signal.SIGTERM) == 0, server.stderr
    finally:
        server.kill()
    assert f"weightstream: {shard} was opened for writing or truncated" in server.stderr, server.stderr


def test_a_shard_truncated_under_generate_exits_with_an_error_naming_it(tiny_model, tmp_path):
    """Case 1 with `generate`: the file truncated while it decodes; it exits 2 with one line naming the file, not a
    signal death (-7, SIGBUS)."""
    model = shutil.copytree(tiny_model("qwen3_moe", max_position_embeddings=4096), tmp_path / "m")
    shard = _dense_shard(model)
    cmd = [sys.executable, "-m", "weightstream.cli", "generate", str(model), "--prompt-ids", "1,2,3"]
    proc = subprocess.Popen([*cmd, "--max-new-tokens", "4000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not _leases_held(proc.pid, shard) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "generate ended before the test could truncate its model"
        assert _truncate_elsewhere(shard, 1000).returncode == 0
        err = proc.communicate(timeout=120)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 2, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.startswith("weightstream generate: error: ")]
    assert len(lines) == 1 and shard in lines[0] and "Traceback" not in err, err


def test_a_shard_renamed_over_or_deleted_under_the_model_keeps_the_loaded_bytes(tiny_model, tmp_path):
    """Case 1's other changes need no notice: a shard replaced by rename or deleted leaves the running model the
    bytes it loaded (its mappings and descriptors hold the old file): the same tokens, no error."""
    from weightstream.engine.generate import generate
    from weightstream.engine.loader import load_streaming_model

    model_dir = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m")
    shard = _dense_shard(model_dir)
    model = load_streaming_model(str(model_dir), expert_cache="1x")
    try:
        ids = torch.tensor([[1, 2, 3]])
        want = generate(model, ids, 8)[0]
        spare = tmp_path / "spare"
        shutil.copy(shard, spare)
        with open(spare, "r+b") as f:  # other bytes in the replacement: a reread would give other tokens
            f.seek(os.path.getsize(spare) - 4096)
            f.write(os.urandom(4096))
        os.rename(spare, shard)
        assert torch.equal(generate(model, ids, 8)[0], want)
        os.unlink(shard)
        assert torch.equal(generate(model, ids, 8)[0], want)
    finally:
        model.weightstream.close()
