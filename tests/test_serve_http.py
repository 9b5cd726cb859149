"""`weightstream serve` as clients use it: a real server on 127.0.0.1, the official openai client and raw HTTP.

One server for the module (tiny qwen3_moe in fp32 with a chat template written into its tokenizer_config.json,
an API key, a 256 KiB KV budget = 341 positions, a clock-floor listener on its announce socket). Answers are
compared with `weightstream generate` (once as the command, otherwise its Python function on the same model).
"""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from weightstream.clock.activity import AnnounceListener
from weightstream.engine.generate import generate
from weightstream.engine.loader import load_streaming_model, load_tokenizer

from serve_support import ServerProcess, metric

KEY = "sk-test-weightstream"
NAME = "tiny-chat"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = [
    "Hello there",
    "The quick brown fox",
    "Once upon a time",
    "def add(a, b):",
    "What is the capital of France?",
    "1 2 3 4 5",
    "Paris",
    "Reading the gate projection first",
]


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """A copy of the tiny model whose tokenizer_config.json carries a chat template."""
    model_dir = tmp_path_factory.mktemp("serve") / NAME
    shutil.copytree(tiny_model("qwen3_moe"), model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(model_dir)


@pytest.fixture(scope="module")
def listener(tmp_path_factory):
    listener = AnnounceListener(str(tmp_path_factory.mktemp("clock") / "activity.sock"))
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def server(chat_model, listener):
    args = ("--api-key", KEY, "--max-batch", "8", "--kv-cache", "256KiB", "--expert-cache", "2x", "--io-threads", "2")
    server = ServerProcess(chat_model, *args, env={"WEIGHTSTREAM_CLOCKFLOOR_SOCKET": listener.path})
    try:
        server.wait_ready()
        yield server
        assert server.signal(signal.SIGINT) == 130, server.stderr  # Ctrl-C: the CLI's "interrupted" status
        assert "scheduler and I/O threads stopped" in server.stderr
    finally:
        server.kill()


@pytest.fixture(scope="module")
def engine(chat_model):
    """The same checkpoint in this process, as `weightstream generate` loads it, and its tokenizer."""
    model = load_streaming_model(chat_model, expert_cache="2x", io_threads=2)
    yield model, load_tokenizer(chat_model, required=True)
    model.weightstream.close()


def greedy_text(engine, ids, n):
    model, tokenizer = engine
    new, _ = generate(model, torch.tensor([ids]), n)
    return tokenizer.decode(new[0].tolist(), skip_special_tokens=True), new.shape[1]


def chat_ids(tokenizer, messages):
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)).input_ids


def client(server, **kwargs):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120, max_retries=0, **kwargs)


def test_completions_equal_the_generate_command(server, chat_model):
    r = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "generate", chat_model, "--prompt", "Hello there"]
        + ["--max-new-tokens", "12", "--json", "--expert-cache", "2x", "--io-threads", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    want = json.loads(r.stdout)
    c = client(server)
    got = c.completions.create(model=NAME, prompt="Hello there", max_tokens=12, temperature=0)
    assert got.choices[0].text == want["text"] and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == len(want["token_ids"]) == 12 and got.usage.prompt_tokens == 3
    chunks = list(
        c.completions.create(
            model=NAME,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_renders_the_checkpoints_template_and_equals_generate(server, engine):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    want, n = greedy_text(engine, chat_ids(engine[1], messages), 10)
    c = client(server)
    got = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want
    assert got.usage.completion_tokens == n == 10 and got.usage.prompt_tokens == len(chat_ids(engine[1], messages))
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_seeded_sampling(server, engine):
    c = client(server)
    full = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=30, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    sampled = [
        c.completions.create(model=NAME, prompt="Paris", max_tokens=16, temperature=0.8, top_p=0.9, seed=s)
        .choices[0]
        .text
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def test_eight_concurrent_clients_each_get_their_own_answer(server, engine):
    """Eight clients at once, two rounds each (streaming, then not): every answer is its solo greedy answer."""
    _, tokenizer = engine
    want = [greedy_text(engine, tokenizer(p).input_ids, 24)[0] for p in PROMPTS]
    before = httpx.get(f"{server.url}/metrics").text
    start = threading.Barrier(len(PROMPTS))
    answers: dict[tuple[int, int], str] = {}

    def user(i: int) -> None:
        c = client(server)
        start.wait(timeout=60)
        for round_ in range(2):  # a bounded loop: two requests, then the thread ends
            if round_ == 0:
                chunks = c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0, stream=True)
                answers[i, round_] = "".join(ch.choices[0].text for ch in chunks)
            else:
                answers[i, round_] = (
                    c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0).choices[0].text
                )

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert answers == {(i, r): want[i] for i in range(len(PROMPTS)) for r in range(2)}
    after = httpx.get(f"{server.url}/metrics").text
    ok = 'endpoint="completions",status="200"'
    assert metric(after, "weightstream_requests_total", ok) - metric(before, "weightstream_requests_total", ok) == 16
    steps = metric(after, "weightstream_decode_batch_size_count") - metric(
        before, "weightstream_decode_batch_size_count"
    )
    alone = metric(after, "weightstream_decode_batch_size_bucket", 'le="1.0"') - metric(
        before, "weightstream_decode_batch_size_bucket", 'le="1.0"'
    )
    assert steps - alone > 0, "no decode step ran more than one sequence"
    union = metric(after, "weightstream_decode_distinct_experts_total") / metric(
        after, "weightstream_decode_expert_choices_total"
    )
    assert 0 < union < 1  # batched steps shared experts
    assert metric(after, "weightstream_running_batch_size") == 0 and metric(after, "weightstream_queue_depth") == 0


def bad(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    r = httpx.post(f"{server.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"})
    return r.status_code, r.json()["error"]


def test_bad_input_gets_a_clear_error_and_changes_nothing(server):
    before = httpx.get(f"{server.url}/metrics").text
    ids_600 = [3 + i % 500 for i in range(600)]
    cases = [
        ("/v1/completions", b'{"model": "tiny-chat", "prompt": "Hi",', None, 400, "not valid JSON", None),
        ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, None, 404, "does not exist", "model_not_found"),
        ("/v1/completions", {"model": NAME}, None, 400, "prompt: Field required", None),
        ("/v1/chat/completions", {"model": NAME}, None, 400, "messages: Field required", None),
        ("/v1/completions", {"prompt": "Hi"}, None, 400, "model: Field required", None),
        (
            "/v1/completions",
            {"model": NAME, "prompt": "Hi", "max_tokens": 600},
            None,
            400,
            "ask for at most 510",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": NAME, "prompt": ids_600},
            None,
            400,
            "shorten the prompt",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 400}, None, 400, "larger --kv-cache", None),
        ("/v1/completions", {"model": NAME, "prompt": "Hi", "n": 2}, None, 400, "n=2 is not supported", None),
        ("/v1/completions", {"model": NAME, "prompt": "Hi", "temperature": -1}, None, 400, "temperature", None),
        ("/v1/completions", {"model": NAME, "prompt": [99999]}, None, 400, "token ids must be in 0..511", None),
        ("/v1/completions", {"model": NAME, "prompt": "Hi"}, "sk-wrong", 401, "wrong API key", "invalid_api_key"),
        ("/v1/completions", {"model": NAME, "prompt": "Hi"}, "", 401, "wrong API key", "invalid_api_key"),
        ("/v1/completions", {"model": NAME, "prompt": "x" * (17 * 2**20)}, None, 413, "exceeds 16 MiB", None),
    ]
    for path, body, key, status, message, code in cases:
        got_status, error = bad(server, path, body, KEY if key is None else key)
        assert (got_status, code) == (status, error["code"]), (body, error)
        assert message in error["message"] and error["type"], (body, error)
    models = httpx.get(f"{server.url}/v1/models")
    assert models.status_code == 401
    after = httpx.get(f"{server.url}/metrics").text
    assert metric(after, "weightstream_prompt_tokens_total") == metric(before, "weightstream_prompt_tokens_total")
    c = client(server)  # and the server still serves
    assert c.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_a_client_that_disconnects_frees_its_place(server):
    """Mid-stream, or while waiting for a whole answer: the sequence is cancelled and leaves the batch."""
    url, headers = f"{server.url}/v1/completions", {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "Paris", "max_tokens": 300, "temperature": 0}
    cancelled = lambda text: metric(text, "weightstream_sequences_ended_total", 'outcome="cancelled"')  # noqa: E731
    before = cancelled(httpx.get(f"{server.url}/metrics").text)
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")  # the sequence is running: its first token came
    wait_for_metrics(server, lambda t: cancelled(t) == before + 1 and metric(t, "weightstream_running_batch_size") == 0)
    with pytest.raises(httpx.ReadTimeout):  # gives up long before 300 tokens, and hangs up
        httpx.post(url, json=body, headers=headers, timeout=httpx.Timeout(60, read=0.3))
    text = wait_for_metrics(server, lambda t: cancelled(t) == before + 2)
    assert metric(text, "weightstream_running_batch_size") == 0


def wait_for_metrics(server, condition, timeout=60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics").text
        if condition(text):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


def test_models_health_and_metrics(server):
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == 512
    assert client(server).models.list().data[0].id == NAME
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "weightstream_requests_total",
        "weightstream_prompt_tokens_total",
        "weightstream_generation_tokens_total",
        "weightstream_decode_tokens_per_second",
        "weightstream_queue_depth",
        "weightstream_running_batch_size",
        "weightstream_decode_batch_size_bucket",
        "weightstream_expert_hit_rate",
        "weightstream_device_read_bytes_total",
        "weightstream_io_wait_seconds_total",
        "weightstream_expert_cache_bytes",
        "weightstream_kv_cache_bytes",
        "weightstream_kv_cache_budget_bytes",
        "weightstream_time_per_output_token_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    assert metric(text, "weightstream_kv_cache_budget_bytes") == 256 * 1024
    assert metric(text, "weightstream_device_read_bytes_total") > 0 and metric(text, "weightstream_ready") == 1


def test_decode_steps_announce_themselves_to_the_clock_floor(server, listener):
    listener.collect()
    # the announcer sends at most once per 0.2 s, and waits 1 s after a send that failed (a full socket buffer)
    time.sleep(1.2)
    client(server).completions.create(model=NAME, prompt="Hello there", max_tokens=8, temperature=0)
    assert server.pid in listener.collect()
