"""`weightstream serve` under load for minutes (issue 52, item 5): --clients concurrent clients send completions and
chat requests for --duration seconds, streamed and not, some cancelled mid-answer (the client hangs up), some bad
(wrong types, out-of-range values, missing fields, unknown endpoints); every good request must answer in full,
every bad one with a 4xx and an OpenAI-style error body, and the server's memory must not grow.

Measured: requests by kind and their outcomes (errors: a good request not answered in full, a bad one not a 4xx,
a 5xx, a transport error), the server's RSS sampled every --sample-s seconds (after a --warmup-s warm-up, then at
the end, the largest, at each minute, and the least-squares growth per minute after warm-up and over the second
half), and its /metrics once the clients have stopped and it is idle: running and queued sequences and the KV
cache's bytes (0 when every cancelled sequence was freed), sequences ended by outcome (cancelled among them).
The baseline in the same run: the RSS after warm-up, against which the end's is a ratio.

Example (a tiny model with a chat template is built in .work/ unless MODEL is given):
    .venv/bin/python benchmarks/serve_bench.py load --duration 300 --clients 32 -o benchmarks/results/serve-load.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import psutil
from common.clients import free_port, stderr_lines, wait_ready
from common.results import emit
from prometheus_client.parser import text_string_to_metric_families

BAD_BODIES = (
    ("completions", {"prompt": "Hello", "max_tokens": True}),
    ("completions", {"prompt": "Hello", "max_tokens": -3}),
    ("completions", {"prompt": 17}),
    ("completions", {}),
    ("completions", {"model": "no-such-model", "prompt": "Hi"}),
    ("completions", {"prompt": "Hi", "temperature": "hot"}),
    ("completions", {"prompt": "Hi", "max_tokens": 10**9}),
    ("completions", {"prompt": "Hi", "stop": {"a": 1}}),
    ("completions", {"prompt": "Hi", "logprobs": 1000}),
    ("chat/completions", {"messages": "hello"}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": ["\ud800"]}]}),
    ("chat/completions", {"messages": [], "max_tokens": 4}),
    ("embeddings", {"input": "hello"}),
)
WORDS = "the cache reads experts from a drive while the model decodes tokens one at a time in order".split()


def _tiny_chat_model(root: str) -> str:
    """A tiny qwen3_moe (synth's, which has a chat template), built once."""
    out = os.path.join(root, "load-model")
    if not os.path.exists(os.path.join(out, "config.json")):
        cmd = [sys.executable, "-m", "weightstream.cli", "synth", "--preset", "tiny", "--arch", "qwen3_moe"]
        subprocess.run([*cmd, "--out", out, "--force"], check=True, stdout=subprocess.DEVNULL)
    return out


class Load:
    """The clients' shared tallies."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kinds: Counter = Counter()
        self.errors: list[str] = []
        self.cancelled = 0

    def count(self, kind: str, error: str | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            if error is not None and len(self.errors) < 50:
                self.errors.append(f"{kind}: {error}")
            if error is not None:
                self.kinds[f"{kind} errors"] += 1

    def hung_up(self, kind: str) -> None:
        """A request of `kind` the client hung up on before its answer ended."""
        with self.lock:
            self.cancelled += 1
        self.count(kind)


def _good(rng: random.Random, chat: bool, stream: bool) -> tuple[str, dict, int]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    max_tokens = rng.randint(1, 24)
    body = {"max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0, 0.7])}
    if chat:
        return "chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, max_tokens
    return "completions", {**body, "prompt": prompt}, max_tokens


def _one(client: httpx.Client, url: str, rng: random.Random, load: Load, args) -> None:
    roll = rng.random()
    if roll < args.bad_share:
        endpoint, body = rng.choice(BAD_BODIES)
        raw = json.dumps({"model": args.model_name, **body})  # \ud800 escaped, as a client's JSON may hold it
        r = client.post(f"{url}/v1/{endpoint}", content=raw, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        load.count("bad", None if ok else f"{endpoint} {body} -> {r.status_code} {r.text[:200]}")
        return
    stream = rng.random() < 0.5
    endpoint, body, max_tokens = _good(rng, rng.random() < 0.5, stream)
    body["model"] = args.model_name
    cancel = roll < args.bad_share + args.cancel_share
    kind = f"{'cancelled' if cancel else 'good'} {'stream' if stream else 'plain'}"
    if not stream and cancel:  # hang up before the answer: a read timeout shorter than the request
        try:
            client.post(f"{url}/v1/{endpoint}", json={**body, "max_tokens": 24}, timeout=rng.uniform(0.01, 0.2))
        except httpx.TimeoutException:
            pass
        load.hung_up(kind)
        return
    if stream:
        chunks, done = 0, False
        with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
            if r.status_code != 200:
                load.count(kind, f"{r.status_code} {r.read()[:200]!r}")
                return
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                done = done or line == "data: [DONE]"
                if cancel and chunks >= rng.randint(1, 3):
                    load.hung_up(kind)
                    return  # leaving the block closes the connection mid-stream
        load.count(kind, None if chunks >= 1 and done else f"stream ended after {chunks} chunks, no [DONE]")
        return
    r = client.post(f"{url}/v1/{endpoint}", json=body)
    if r.status_code != 200:
        load.count(kind, f"{r.status_code} {r.text[:200]}")
        return
    usage = r.json()["usage"]
    full = usage["completion_tokens"] == max_tokens or r.json()["choices"][0]["finish_reason"] == "stop"
    load.count(kind, None if full else f"{usage} of {max_tokens}")


def _client(url: str, seed: int, deadline: float, load: Load, args) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                _one(client, url, rng, load, args)
            except httpx.HTTPError as exc:
                load.count("transport", f"{type(exc).__name__}: {exc}")


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _metrics(url: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name.startswith("weightstream_") and not sample.name.endswith("_created"):
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
    return out


def _by_minute(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The first sample at or after each whole minute (and the first): how the RSS moved, read at a glance."""
    out, minute = [], 0
    for t, r in samples:
        if t >= 60 * minute:
            out.append((t, r))
            minute = int(t // 60) + 1
    return out


def _growth_per_minute(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS against time, bytes a minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (r - mr) for t, r in samples) / var if var else 0.0


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory (default: a tiny chat model built in .work/)")
    ap.add_argument("--duration", type=float, default=300, help="seconds of load (default 300)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--bad-share", type=float, default=0.15, help="share of requests that are bad (default 0.15)")
    ap.add_argument("--cancel-share", type=float, default=0.2, help="share cancelled by their client (default 0.2)")
    ap.add_argument("--warmup-s", type=float, default=30, help="RSS after this long is the baseline (default 30)")
    ap.add_argument("--sample-s", type=float, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="--expert-cache 2x --max-batch 8", help="more `serve` options")
    ap.add_argument("-o", "--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    model = args.model or _tiny_chat_model(".work")
    port = free_port()
    cmd = [sys.executable, "-m", "weightstream.cli", "serve", model, "--port", str(port), *args.serve_args.split()]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines = stderr_lines(proc)
    try:
        url = wait_ready(proc, lines, f"http://127.0.0.1:{port}", timeout=600)
        if url is None:
            raise SystemExit(f"serve did not start: {''.join(lines)[-2000:]}")
        args.model_name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        result = _run(url, proc.pid, args)
        result.update(model=model, serve=" ".join(cmd[3:]))
        result["server_alive"] = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    emit(result, args.out)


def _run(url: str, pid: int, args) -> dict:
    load = Load()
    start = time.monotonic()
    deadline = start + args.duration
    threads = [
        threading.Thread(target=_client, args=(url, args.seed * 1000 + i, deadline, load, args))
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - start, _rss(pid)))
        time.sleep(args.sample_s)
    for t in threads:
        t.join()
    time.sleep(2)  # the last hang-ups reach the scheduler
    idle = _metrics(url)
    after = [r for t, r in samples if t >= args.warmup_s] or [samples[-1][1]]
    end_rss = _rss(pid)
    kinds = dict(load.kinds)
    errors = sum(v for k, v in kinds.items() if k.endswith("errors") or k == "transport")
    return {
        "seconds": round(time.monotonic() - start, 1),
        "clients": args.clients,
        "requests": {k: v for k, v in sorted(kinds.items()) if not k.endswith("errors")},
        "errors": errors,
        "error_examples": load.errors[:10],
        "cancelled_by_clients": load.cancelled,
        "rss_mib": {
            "after_warmup": round(after[0] / 2**20, 1),
            "end": round(end_rss / 2**20, 1),
            "max": round(max(r for _, r in samples) / 2**20, 1),
            "end_over_warmup": round(end_rss / after[0], 3),
            "growth_mib_per_min_after_warmup": round(
                _growth_per_minute([(t, r) for t, r in samples if t >= args.warmup_s]) / 2**20, 2
            ),
            "growth_mib_per_min_second_half": round(
                _growth_per_minute([(t, r) for t, r in samples if t >= args.duration / 2]) / 2**20, 2
            ),
            "by_minute": [round(r / 2**20, 1) for t, r in _by_minute(samples)],
        },
        "idle_metrics": {
            k: v
            for k, v in idle.items()
            if k.split("{")[0]
            in (
                "weightstream_running_batch_size",
                "weightstream_queue_depth",
                "weightstream_kv_cache_bytes",
                "weightstream_sequences_ended_total",
                "weightstream_requests_total",
            )
        },
    }
