"""`weightstream serve` starting and stopping: SIGTERM while a stream runs, health before the model is loaded,
and errors that stop it before it serves (one clear line, status 2)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import openai
from starlette.testclient import TestClient

from weightstream.cli import main
from weightstream.serve.app import build_app
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.service import ModelService, ServeSettings

from serve_support import ServerProcess, metric


def test_sigterm_while_streaming_ends_the_stream_and_exits_cleanly(tiny_model, tmp_path):
    """Grace 0: the running stream gets an error event at once, the process stops its threads and exits 0. (The
    model is one without a chat template, so chat is refused with a clear error first.)"""
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model("qwen3_moe"), model_dir)
    os.remove(os.path.join(model_dir, "chat_template.jinja"))  # synth writes one
    server = ServerProcess(model_dir, "--shutdown-grace", "0", "--expert-cache", "2x", "--io-threads", "2")
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
        try:
            c.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            raise AssertionError("chat without a chat template was accepted")
        except openai.BadRequestError as exc:
            assert exc.status_code == 400 and exc.code == "chat_template_missing" and "no chat template" in exc.message
        first, outcome = threading.Event(), {}

        def stream() -> None:
            try:
                for chunk in c.completions.create(
                    model="model", prompt="Paris", max_tokens=400, temperature=0, stream=True
                ):
                    outcome.setdefault("first", chunk.choices[0].text)
                    first.set()
                outcome["end"] = "completed"
            except openai.APIError as exc:
                outcome["end"] = exc.message
            first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(120) and "first" in outcome, server.stderr
        rc = server.signal(signal.SIGTERM)
        reader.join(60)
    finally:
        server.kill()
    assert rc == 0, server.stderr
    assert "shutting down" in outcome["end"], outcome
    err = server.stderr
    assert "SIGTERM: finishing requests in flight" in err and "1 ended by the shutdown" in err
    assert "scheduler and I/O threads stopped" in err and "Traceback" not in err


def test_health_is_503_and_requests_wait_for_nothing_until_the_model_is_loaded(tiny_model):
    """The app before its lifespan has loaded anything: not ready, and saying so in OpenAI's error shape."""
    metrics = ServeMetrics()
    service = ModelService(ServeSettings(tiny_model("qwen3_moe")), metrics)
    metrics.engine = service
    client = TestClient(build_app(service, metrics))  # not entered: no lifespan, so nothing loads
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    r = client.post("/v1/completions", json={"model": "model", "prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
    assert metric(client.get("/metrics").text, "weightstream_ready") == 0


def test_errors_before_serving_are_one_clear_line(tiny_model, capsys):
    """Bad options and a port in use fail before anything loads; a model that cannot load stops the server."""
    model_dir = tiny_model("qwen3_moe")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        assert main(["serve", model_dir, "--port", str(taken.getsockname()[1])]) == 2
    finally:
        taken.close()
    assert "cannot listen there" in capsys.readouterr().err
    assert main(["serve", model_dir, "--max-batch", "0"]) == 2
    assert "--max-batch 0: must be at least 1" in capsys.readouterr().err
    assert main(["serve", model_dir, "--kv-cache", "lots"]) == 2
    assert "--kv-cache" in capsys.readouterr().err
    cmd = [sys.executable, "-m", "weightstream.cli", "serve", model_dir, "--port", "0", "--expert-cache", "0.5x"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # refused while loading, after listening
    assert r.returncode == 2 and "below one token's working set" in r.stderr and "Traceback" not in r.stderr, r.stderr
