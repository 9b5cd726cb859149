"""`weightstream serve` under more requests than it runs: the waiting queue is bounded (--max-queue), and a request
beyond it gets 429 with Retry-After at once instead of waiting without limit."""

import threading
import time

import httpx

from serve_support import ServerProcess, endless, metric


def test_requests_beyond_the_queue_bound_get_429_with_retry_after(tiny_model):
    """One sequence at a time (--max-batch 1) and at most two waiting: with one running, the next two wait and
    finish once it ends; the fourth is refused with an OpenAI error object, code queue_full."""
    model = tiny_model("qwen3_moe")
    server = ServerProcess(model, "--max-batch", "1", "--max-queue", "2", "--expert-cache", "2x", "--io-threads", "2")
    try:
        server.wait_ready()
        url = f"{server.url}/v1/completions"
        short = {"model": "model", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        answers = {}

        def wait_in_queue(i: int) -> None:
            answers[i] = httpx.post(url, json=short, timeout=120)

        long = {"model": "model", "prompt": "Paris", "max_tokens": 500, "temperature": 0, "stream": True}
        long["logit_bias"] = endless(model)  # it runs until the stream closes
        with httpx.stream("POST", url, json=long, timeout=120) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which cancels the request
            assert next(lines).startswith("data: ")  # it runs: the batch of one is full
            waiting = [threading.Thread(target=wait_in_queue, args=(i,)) for i in range(2)]
            for t in waiting:
                t.start()
            _wait_for(server, lambda text: metric(text, "weightstream_queue_depth") == 2)
            refused = httpx.post(url, json=short, timeout=60)
            depth = metric(httpx.get(f"{server.url}/metrics").text, "weightstream_queue_depth")
        # leaving the `with` closed the long stream: its sequence is cancelled and the two waiting ones run
        for t in waiting:
            t.join(120)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "--max-queue 2" in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}
        assert depth == 2  # the refused request never queued
        assert [answers[i].status_code for i in range(2)] == [200, 200]
        assert all(answers[i].json()["usage"]["completion_tokens"] == 4 for i in range(2))
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "weightstream_requests_total", 'endpoint="completions",status="429"') == 1
    finally:
        server.kill()


def _wait_for(server, condition, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition(httpx.get(f"{server.url}/metrics").text):
        assert time.monotonic() < deadline, server.stderr
        time.sleep(0.02)
