"""`weightstream serve --ray` as a user runs it: without Ray installed it says how to get it (and the rest of the
command works as before); with Ray it starts a cluster of its own, serves, and on SIGTERM leaves no process behind."""

import importlib.util
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from weightstream.cli import main

from serve_support import ServerProcess

HAS_RAY = importlib.util.find_spec("ray") is not None


def test_without_ray_the_command_names_the_extra_and_the_core_still_imports(tiny_model):
    """Ray made unimportable in a fresh interpreter: `serve --ray` is one line naming the extra; `serve`'s own
    modules import without Ray."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import weightstream.serve.server, weightstream.serve.affinity\n"
        "from weightstream.cli import main\n"
        f"sys.exit(main(['serve', {tiny_model('qwen3_moe')!r}, '--ray', '--port', '0']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'weightstream[ray]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ray_options_without_ray_are_refused(tiny_model, capsys):
    assert main(["serve", tiny_model("qwen3_moe"), "--replicas", "2"]) == 2
    assert "--replicas goes with --ray" in capsys.readouterr().err
    assert main(["serve", tiny_model("qwen3_moe"), "--ray", "--step-log", "steps.jsonl"]) == 2
    assert "--step-log" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_RAY, reason="Ray Serve is not installed (pip install 'weightstream[ray]')")
def test_serve_ray_serves_and_sigterm_leaves_no_process(tiny_model):
    """Two replicas; then SIGTERM, idle: every Ray process ended, within a bound far under the 60 s (and Ray's
    "Controller failed to shut down within 30.0s", and a failed-task warning) issue 52 found, case 14 (measured
    here: 4.8 s with both cores busy, Ray's own shutdown 1.4 s of it; 7.9 s and the warning before)."""
    server = ServerProcess(
        tiny_model("qwen3_moe"), "--ray", "--replicas", "2", "--replica-cpus", "0.5", "--expert-cache", "2x"
    )
    try:
        assert server.url, server.stderr
        server.wait_ready()
        body = {"model": "model", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert r.headers["x-weightstream-replica"]
        started = psutil.Process(server.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in started)
        start = time.monotonic()
        assert server.signal(signal.SIGTERM, timeout=120) == 0, server.stderr
        stop_s = time.monotonic() - start
    finally:
        server.kill()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert "stopped; Ray's processes have ended" in server.stderr and "Traceback" not in server.stderr
    stopping = server.stderr[server.stderr.index("stopping:") :]
    assert "failed" not in stopping.lower() and "warning" not in stopping.lower(), stopping
    assert stop_s < 20, (stop_s, stopping)
