"""Fuzzing the request bodies of `weightstream serve`'s OpenAI-compatible API: /v1/completions and
/v1/chat/completions.

The app is driven in this process (Starlette's TestClient, the app's own lifespan loading a tiny qwen3_moe with a
chat template; a 32-position context and an 8-sequence queue keep every accepted request a few ms). Valid bodies
get 1 to 3 edits: any field (every one the endpoint declares, the ones it refuses by name, unknown ones, the chat
messages and their parts, logit_bias keys, stream_options) set to a near miss of its range or type (booleans for
numbers, 2^63, NaN as Python's json writes it, negative, huge and empty values, unicode, nesting) or to any JSON,
or dropped; or the whole body is JSON no reader can hold or not JSON at all. The property: a 2xx whose body is a
well-formed answer (a completion or chat completion with one choice per prompt and n, or server-sent events that
end in [DONE]), or a 4xx with an OpenAI error object that names the field at fault; never a 5xx, a traceback in
the log or a hang.

Seeded and bounded for CI; WEIGHTSTREAM_FUZZ_EXAMPLES=N tries N inputs a test instead (tests/fuzz_support.py).
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from weightstream.serve.app import build_app
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.service import ModelService, ServeSettings

from fuzz_support import fuzz, hostile_json, interesting_ints, json_values, outcome, time_limit
from serve_support import NAME, chat_copy

CONTEXT, QUEUE = 32, 8
COMPLETION = {"model": NAME, "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
SHARED = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "extra_field",
)
FIELDS = {
    "/v1/completions": (*SHARED, "prompt", "echo", "logprobs", "best_of", "suffix"),
    "/v1/chat/completions": (
        *SHARED,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
        "modalities",
        "reasoning_effort",
    ),
}


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    """The app with its lifespan entered (the model loads in the background), once /health says ok."""
    model_dir = chat_copy(tiny_model("qwen3_moe"), tmp_path_factory.mktemp("serve-fuzz"))
    settings = ServeSettings(
        model_dir,
        engine={"expert_cache": "2x", "io_threads": 2},
        max_batch=4,
        max_queue=QUEUE,
        max_model_len=CONTEXT,
        kv_cache="1MiB",
    )
    metrics = ServeMetrics()
    service = ModelService(settings, metrics)
    metrics.engine = service
    with TestClient(build_app(service, metrics), raise_server_exceptions=True) as client:
        deadline = time.monotonic() + 180
        while client.get("/health").status_code != 200:
            assert service.error is None, service.error
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        yield client


def near(field: str):
    """Values just outside (or at the edge of) what `field` takes, and values of the wrong type."""
    numbers = st.one_of(
        st.sampled_from((0, 1, -1, 2, 5, 6, 20, 21, 128, 129, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30)),
        st.sampled_from((0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, 2.0000001, -2.0, 100.0, 100.5, 1e308)),
        st.sampled_from((float("nan"), float("inf"), float("-inf"), True, False, None, "1", "", [1], {"a": 1})),
        interesting_ints(64),
    )
    text = st.one_of(st.text(max_size=30), st.sampled_from(("", "\x00", "é" * 50, "\U0001f600", "a" * 5000)))
    special = {
        "model": st.one_of(text, st.sampled_from((NAME, NAME.upper(), NAME + " ", None, 1))),
        "prompt": st.one_of(
            text,
            st.lists(st.integers(-2, 600), max_size=40),
            st.lists(text, max_size=3),
            st.lists(st.lists(st.integers(-1, 520), max_size=5), max_size=3),
            st.sampled_from(([], [[]], [""], [0], [[0], "a"], [1.5], [True], list(range(CONTEXT + 1)), "x" * 100_000)),
        ),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.one_of(st.sampled_from(("user", "assistant", "system", "tool", "wizard", "")), text),
                        "content": st.one_of(
                            text,
                            st.none(),
                            st.lists(
                                st.fixed_dictionaries(
                                    {
                                        "type": st.sampled_from(("text", "image_url", "")),
                                        "text": st.one_of(text, st.none()),
                                    }
                                ),
                                max_size=3,
                            ),
                            json_values(3),
                        ),
                    },
                    optional={"name": text, "tool_calls": json_values(2)},
                ),
                max_size=4,
            ),
            st.sampled_from(([], [{}], [{"role": "user"}], [{"content": "Hi"}], "Hi", [["user", "Hi"]])),
        ),
        "stop": st.one_of(text, st.lists(text, max_size=6), st.sampled_from(("", [""], ["", ""], [None], "\x00"))),
        "logit_bias": st.one_of(
            st.dictionaries(
                st.one_of(st.sampled_from(("0", "1", "511", "512", "-1", "1" * 19, "01", " 1", "a")), text),
                st.one_of(numbers, st.floats()),
                max_size=4,
            ),
            json_values(2),
        ),
        "stream_options": st.one_of(
            st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), numbers, text)}), json_values(2)
        ),
        "tools": st.one_of(st.just([]), json_values(2)),
        "tool_choice": st.one_of(st.sampled_from(("none", "auto", "required")), json_values(2)),
        "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), json_values(2)),
        "modalities": st.one_of(st.just(["text"]), json_values(2)),
    }
    return special.get(field, st.one_of(numbers, st.booleans(), text))


@st.composite
def bodies(draw, path: str):
    """(raw body bytes, the body as sent when it is JSON) for `path`."""
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.one_of(hostile_json(), st.binary(max_size=40)), label="raw body")
        return bytes(raw), None
    body = json.loads(json.dumps(COMPLETION if path == "/v1/completions" else CHAT))
    for _ in range(draw(st.integers(1, 3), label="edits")):
        field = draw(st.sampled_from(FIELDS[path]), label="field")
        how = draw(st.sampled_from(("near", "near", "json", "drop")), label="how")
        if how == "drop":
            body.pop(field, None)
        else:
            body[field] = draw(near(field) if how == "near" else json_values(), label=field)
    return json.dumps(body).encode(), body


def check_answer(path: str, body: dict, response) -> None:
    """A 200: the answer's shape as OpenAI's clients read it."""
    chat = path == "/v1/chat/completions"
    streamed = response.headers["content-type"].startswith("text/event-stream")
    if any(body.get("stream") is v for v in (True, False, None)):  # others are read as pydantic reads a bool
        assert streamed == (body.get("stream") is True), (body, response.headers)
    if streamed:
        events = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert events, response.text
        if events[-1] != "[DONE]":  # an error mid-stream, as OpenAI sends it: the stream's last event
            error = json.loads(events[-1])["error"]
            assert error["message"] and error["type"], error
            return
        for event in events[:-1]:
            chunk = json.loads(event)
            assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
        return
    answer = response.json()
    assert answer["object"] == ("chat.completion" if chat else "text_completion"), answer
    prompts = body.get("prompt")
    many = not chat and isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))
    want = (len(prompts) if many else 1) * int(body.get("n", 1))  # 2.0 is 2, as pydantic reads it
    assert [c["index"] for c in answer["choices"]] == list(range(want)), answer
    for choice in answer["choices"]:
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str), choice
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT * want, usage


def check_response(path: str, raw: bytes, body: dict | None, response, log: str) -> None:
    outcome(f"HTTP {response.status_code}")  # --hypothesis-show-statistics counts the answers and refusals
    assert "Traceback" not in log and "internal error" not in log, log
    assert response.status_code < 500, (raw[:300], response.status_code, response.text[:2000], log)
    if response.status_code == 200:
        assert body is not None, (raw[:300], response.text[:500])
        check_answer(path, body, response)
        return
    assert 400 <= response.status_code < 500, (raw[:300], response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert error["message"] and "\n" not in error["message"] and error["type"] == "invalid_request_error", error
    if error["param"] is not None:
        assert error["param"].split(".")[0] in (body or {}) or error["param"] in error["message"], error


def post(client, path: str, raw: bytes):
    with time_limit(f"POST {path} {raw[:100]!r}"):
        return client.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@fuzz(100)
@given(data=st.data())
def test_any_body_gets_an_answer_or_a_4xx_naming_the_field(client, capsys, path, data):
    raw, body = data.draw(bodies(path), label="body")
    capsys.readouterr()
    response = post(client, path, raw)
    check_response(path, raw, body, response, capsys.readouterr().err)


def test_the_undamaged_bodies_are_answered(client):
    """Where the fuzzers start: bodies that are answered, streamed or whole."""
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for stream in (False, True):
            sent = {**body, "stream": stream}
            response = post(client, path, json.dumps(sent).encode())
            assert response.status_code == 200, response.text
            check_answer(path, sent, response)
