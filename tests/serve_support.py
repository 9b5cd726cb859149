"""A real `weightstream serve` process for tests: started on a free port, its stderr collected, stopped by signal."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
from transformers import AutoConfig, GenerationConfig

READY_TIMEOUT_S = 180
NAME = "tiny-chat"  # the served model's name: the directory's
TEMPLATE = (  # a chat template whose answers the tests know (synth's own answers differently)
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_copy(model_dir: str, folder) -> str:
    """A copy of `model_dir` named NAME in `folder`, whose chat template is TEMPLATE."""
    out = os.path.join(str(folder), NAME)
    shutil.copytree(model_dir, out)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return out


@contextlib.contextmanager
def serving(model_dir: str, *args: str, env: dict | None = None):
    """A `weightstream serve` process on `model_dir`, ready, killed at the end whatever happened."""
    server = ServerProcess(model_dir, *args, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def loaded(model_dir: str, **options):
    """(model, tokenizer): the same checkpoint in this process, as `weightstream generate` loads it."""
    from weightstream.engine.loader import load_streaming_model, load_tokenizer

    model = load_streaming_model(model_dir, **options)
    try:
        yield model, load_tokenizer(model_dir, required=True)
    finally:
        model.weightstream.close()


class ServerProcess:
    """`weightstream serve MODEL_DIR --port 0 ARGS...`; `url` once it listens, `wait_ready()` until /health is ok.
    With `cgroup` (a weightstream.cgroup.MemoryCgroup) the server runs inside it."""

    def __init__(self, model_dir: str, *args: str, env: dict | None = None, cgroup=None):
        cmd = [sys.executable, "-m", "weightstream.cli", "serve", model_dir, "--port", "0", *args]
        if cgroup is not None:
            cmd = cgroup.enter_argv(cmd)  # a shell that moves itself in, then execs the server (same pid)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_for_url()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def _wait_for_url(self) -> str | None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(r"listening on (http://\S+?);", self.stderr)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                self._reader.join(5)
                return None
            time.sleep(0.05)
        raise AssertionError(f"server did not start listening:\n{self.stderr}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.stderr}"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server never became ready:\n{self.stderr}")

    def signal(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send `sig`; the exit status once the process has ended."""
        self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (0 when absent), e.g. metric(t, 'x_total', 'outcome="stop"')."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, flags=re.M)
    return float(match.group(1)) if match else 0.0


def endless(model_dir: str) -> dict[str, float]:
    """A logit_bias that bans the model's end-of-sequence tokens (those serve stops at): a greedy request then runs
    to its max_tokens, however the random model's argmax falls on this CPU."""
    eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir)).eos_token_id
    return {str(token): -100 for token in ([eos] if isinstance(eos, int) else eos or [])}


def hang_up_after(seconds: float, url: str, body: dict, **kwargs) -> None:
    """POST a request for a whole answer and give up waiting after `seconds` (its connection closes); fails, with
    what came back, if the answer came sooner."""
    try:
        r = httpx.post(url, json=body, timeout=httpx.Timeout(60, read=seconds), **kwargs)
    except httpx.ReadTimeout:
        return
    raise AssertionError(f"answered within {seconds} s, so nothing was left to cancel: {r.status_code} {r.text[:500]}")
