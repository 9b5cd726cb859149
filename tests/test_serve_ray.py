"""`weightstream serve` as Ray Serve replicas, on a local Ray cluster this module starts (2 CPUs, 127.0.0.1, no
dashboard) and shuts down, leaving no process behind.

Two applications of two replicas each, on a copy of the tiny qwen3_moe with a chat template: `plain` (the model's own
routing), whose answers are compared with a `weightstream serve` process's, and `traced`, which replays a two-request
routing trace per prompt (request 0 routes every token to experts 0 and 1, request 1 to experts 6 and 7), so which
replica holds a prompt's experts is known: there the router's choices and a replica killed mid-stream are tested.
"""

import json
import os
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'weightstream[ray]')")
serve = pytest.importorskip("ray.serve")

from weightstream.commands.serve import ray_app  # noqa: E402
from weightstream.engine.batching.replay import prompt_request  # noqa: E402
from weightstream.engine.loader import load_tokenizer  # noqa: E402
from weightstream.serve.ray.app import REPLICA_DEPLOYMENT, RayOptions, application  # noqa: E402
from weightstream.serve.service import ServeSettings  # noqa: E402
from weightstream.trace import ModelShape, TraceWriter, save  # noqa: E402

from serve_support import NAME, ServerProcess, chat_copy, endless, hang_up_after  # noqa: E402

PROMPTS = ["Hello there", "The quick brown fox", "def add(a, b):", "What is the capital of France?"]
ENGINE = {"expert_cache": "2x", "io_threads": 2}
TRACE_EXPERTS = ([0, 1], [6, 7])  # trace request r: every token, every layer
TRACE_TOKENS = 400  # per trace request: longer than any sequence here, so none runs into the next request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    # a context of 4096 positions: the cancellation test's request must still be decoding when its client goes
    return chat_copy(tiny_model("qwen3_moe", max_position_embeddings=4096), tmp_path_factory.mktemp("ray"))


@pytest.fixture(scope="module")
def two_group_trace(tmp_path_factory):
    shape = ModelShape("two-groups", [0, 1, 2], n_experts=8, top_k=2, expert_bytes=[1, 1, 1])
    writer = TraceWriter(shape, source="two-groups")
    for request, experts in enumerate(TRACE_EXPERTS):
        writer.begin_step(request, "prefill", n_tokens=TRACE_TOKENS)
        for layer in shape.layers:
            writer.add(layer, experts * TRACE_TOKENS)
    path = tmp_path_factory.mktemp("trace") / "two-groups.npz"
    save(writer.finish(), path)
    return str(path)


@pytest.fixture(scope="module")
def reference(chat_model):
    """`weightstream serve` on the same model: what the Ray replicas must answer."""
    server = ServerProcess(chat_model, "--expert-cache", "2x", "--io-threads", "2")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def cluster(chat_model, two_group_trace, reference):
    """Ray on 127.0.0.1 with 2 CPUs, the two applications; at the end Serve and Ray shut down and every process
    Ray started has exited."""
    os.environ["RAY_metrics_report_interval_ms"] = "500"  # Ray's metrics export every 0.5 s instead of 10
    metrics_port, http_port = _free_port(), _free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        namespace="weightstream-test",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        # `plain` as Ray's own `serve run weightstream.commands.serve:ray_app model=... replicas=2 ...` builds it
        plain = ray_app(
            {"model": chat_model, "replicas": 2, "replica_cpus": 0.5, "expert_cache": "2x", "io_threads": 2}
        )
        options = RayOptions(replicas=2, replica_cpus=0.5, stats_period_s=0.5)
        traced = ServeSettings(chat_model, engine=ENGINE, routing_trace=two_group_trace)
        serve.run(plain, name="plain", route_prefix="/")
        serve.run(application(traced, options), name="traced", route_prefix="/traced")
        ours = {p.pid for p in [psutil.Process(reference.pid), *psutil.Process(reference.pid).children(True)]}
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in ours]
        yield {"url": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        serve.shutdown()
        ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"Ray left processes behind: {[(p.pid, p.name()) for p in alive]}"


def client(base: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0, **kwargs)


def test_ray_replicas_answer_as_weightstream_serve(cluster, reference):
    """Greedy completions (whole and streamed) and chat, and error objects, are those of `weightstream serve`."""
    reference.wait_ready()
    ours, theirs = client(cluster["url"]), client(reference.url)
    for prompt in PROMPTS:
        args = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        want = theirs.completions.create(**args)
        got = ours.completions.create(**args)
        assert got.choices[0].text == want.choices[0].text and got.usage == want.usage, prompt
        streamed = "".join(c.choices[0].text for c in ours.completions.create(**args, stream=True))
        assert streamed == want.choices[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[-1]}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 10, "temperature": 0}
    want = theirs.chat.completions.create(**chat).choices[0].message.content
    assert ours.chat.completions.create(**chat).choices[0].message.content == want
    wrong = [
        ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "Hi"}]}),
        ("/v1/completions", {"model": NAME, "prompt": "Hi", "stop": list("abcde")}),
    ]
    for path, body in wrong:
        a, b = httpx.post(cluster["url"] + path, json=body), httpx.post(reference.url + path, json=body)
        assert (a.status_code, a.json()) == (b.status_code, b.json()), body
    assert httpx.get(cluster["url"] + "/health").json() == {"status": "ok", "model": NAME}
    assert httpx.get(cluster["url"] + "/metrics").json()["error"]["code"] == "metrics_in_ray"


def test_a_client_gone_cancels_its_request_on_the_replica(cluster, chat_model):
    """Mid-stream or waiting for a whole answer: Ray Serve cancels the forwarded call, the replica's app sees the
    disconnect and the sequence leaves the batch, as without Ray. The requests cannot end on their own before their
    clients go: end of sequence is banned and 4000 tokens take seconds on any CPU (400 once ended within the 0.5 s
    read timeout on a CI machine)."""
    url = f"{cluster['url']}/v1/completions"
    body = {"model": NAME, "prompt": "Paris", "max_tokens": 4000, "temperature": 0, "logit_bias": endless(chat_model)}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
        assert next(stream.iter_lines()).startswith("data: ")
    hang_up_after(0.5, url, body)

    def settled() -> bool:
        ended = _ray_metric(cluster, "ray_weightstream_sequences_ended_total", application="plain", outcome="cancelled")
        running = _ray_metric(cluster, "ray_weightstream_running_batch_size", application="plain")
        return sum(ended.values()) == 2 and sum(running.values()) == 0

    _wait(settled, what="both requests cancelled on their replicas and out of the batch")


def _prompts_by_trace_request(chat_model) -> dict[int, str]:
    tokenizer, found = load_tokenizer(chat_model, required=True), {}
    for i in range(100):
        prompt = f"Tell me about topic {i}"
        found.setdefault(prompt_request(tokenizer(prompt).input_ids, len(TRACE_EXPERTS)), prompt)
    return found


def _served_by(base: str, prompt: str, max_tokens: int = 8) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.headers["x-weightstream-replica"]


def _ray_metric(cluster, name: str, **tags) -> dict[str, float]:
    """Samples of `name` in Ray's metrics export whose tags include `tags`: {replica: value}."""
    out = {}
    for line in httpx.get(cluster["metrics"], timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in tags.items()):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _wait(condition, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
    return result


def test_a_prompt_goes_to_the_replica_holding_its_experts(cluster, chat_model):
    """A prompt comes back to the replica whose cache holds the experts its prefill chose, once the replicas have
    reported them (every 0.5 s here): the router's decisions say `experts`, in Ray's metrics export with each
    replica's own metrics."""
    base = cluster["url"] + "/traced"
    prompts = _prompts_by_trace_request(chat_model)
    first = {r: _served_by(base, prompts[r]) for r in prompts}
    time.sleep(1.5)  # the replicas' next reports name both prompts
    again = {r: {_served_by(base, prompts[r]) for _ in range(3)} for r in prompts}
    assert again == {r: {first[r]} for r in prompts}
    decisions = lambda reason: sum(  # noqa: E731
        _ray_metric(cluster, "ray_weightstream_router_decisions_total", application="traced", reason=reason).values()
    )
    reasons = ("experts", "prefix", "least_loaded", "imbalanced")
    _wait(lambda: sum(decisions(r) for r in reasons) >= 8, what="the router's 8 decisions in Ray's metrics export")
    # a repeat finds its prompt in the replicas' reports (`experts`) or, before the next report, in the router's
    # own memory (`prefix`); reports every 0.5 s reach the router within the 1.5 s above on an idle machine
    assert decisions("experts") + decisions("prefix") >= 6 and decisions("experts") >= 1
    tokens = lambda: _ray_metric(cluster, "ray_weightstream_generation_tokens_total", application="traced")  # noqa: E731
    _wait(lambda: set(first.values()) <= set(tokens()), what="the replicas' metrics in Ray's metrics export")
    ready = _ray_metric(cluster, "ray_weightstream_ready", application="traced")
    assert len(ready) == 2 and set(ready.values()) == {1.0}, ready


def _replica_actors(app: str) -> set[str]:
    prefix = f"SERVE_REPLICA::{app}#{REPLICA_DEPLOYMENT}#"
    return {a["name"][len(prefix) :] for a in ray.util.list_named_actors(True) if a["name"].startswith(prefix)}


def test_a_replica_killed_mid_stream_errors_its_request_and_the_other_serves_on(cluster, chat_model):
    """ray.kill on the replica streaming an answer: the stream ends with a replica_died error event, requests go on
    being answered by the other replica meanwhile, and Ray Serve starts a replica in the dead one's place."""
    base = cluster["url"] + "/traced"
    prompts = _prompts_by_trace_request(chat_model)
    body = {"model": NAME, "prompt": prompts[0], "max_tokens": 300, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as stream:
        victim = stream.headers["x-weightstream-replica"]
        lines = stream.iter_lines()
        events.append(next(lines))
        ray.kill(ray.get_actor(f"SERVE_REPLICA::traced#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve"))
        events += [line for line in lines if line.startswith("data: ")]
    error = json.loads(events[-1][6:])["error"]
    assert error["code"] == "replica_died" and "retry" in error["message"], events[-3:]
    survivors = {_served_by(base, prompts[r]) for r in prompts for _ in range(2)}
    assert victim not in survivors and len(survivors) == 1
    replaced = lambda: len(_replica_actors("traced") - {victim}) == 2 and _running_replicas("traced") == 2  # noqa: E731
    _wait(replaced, timeout=90, what="Ray Serve to replace the killed replica")
    assert victim not in _replica_actors("traced")
    answered = {_served_by(base, f"Anyone there {i}?") for i in range(6)}
    assert victim not in answered


def _running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0)


def test_concurrent_clients_each_get_their_solo_answer(cluster):
    """Eight concurrent greedy clients on `plain`, wherever the router sends them: each gets its solo answer."""
    base, c = cluster["url"], client(cluster["url"])
    want = {
        p: c.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0).choices[0].text for p in PROMPTS
    }
    got = {}

    def user(i: int) -> None:
        body = {"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0}
        got[i] = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {i: want[PROMPTS[i % len(PROMPTS)]] for i in range(8)}
