"""`weightstream serve` as Ray Serve replicas: the expert-affinity router against Ray Serve's default router (power of
two choices), on the same replicas, prompts and routing, back to back.

One local Ray cluster for the run. Per round and router (the routers' order alternates between rounds) a fresh
application of --replicas replicas, each a full engine under its own --expert-cache (or --memory), the routing trace
replayed per prompt (a prompt replays the trace request its token ids hash to, so it reads the same experts on any
replica: engine/batching/replay.py; without --trace the model routes itself); then the same requests in the same
shuffled order: --prompts distinct prompts, each sent --repeats times, by --clients concurrent clients, greedy,
exactly --max-tokens each (EOS banned by logit_bias: replayed routing makes the text meaningless). Per run:
aggregate tok/s (completion tokens / wall time from the first request to the last answer), device bytes read per
generated token, prefills included, and the expert hit rate (the replicas' own counters, read from Ray's metrics
export, summed over replicas), requests per replica, and the router's decisions by reason. Per round: affinity /
default for tok/s and for bytes a token. Prints one JSON object.

Part `simulate` (seconds, no Ray): the same requests replayed through one LRU cache per replica (the policy the
engine runs, cache/policy.py), one request after another, prompt and answer token by token, each prompt's requests
on one replica (what affinity aims at) or each request on a replica at random; misses a token per cache size. It
says whether a routing leaves room for affinity before the real run measures it.

    .venv/bin/python benchmarks/serve_bench.py ray simulate .work/olmoe4/q4 --trace .work/ds.npz --caches 1x,2x,4x

    .venv/bin/python benchmarks/serve_bench.py ray .work/olmoe4/q4 --trace .work/ds.npz --expert-cache 2x --rounds 3 \\
        --out benchmarks/results/serve-ray-olmoe4.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter

import httpx
from common.clients import free_port, run_clients
from common.results import default, emit
from prometheus_client.parser import text_string_to_metric_families

from weightstream.bench.machine import block_device_of, machine_info
from weightstream.bench.prompts import BUILTIN_PROMPTS
from weightstream.serve.service import ServeSettings

ROUTERS = ("expert-affinity", "default")


def say(msg: str) -> None:
    print(f"[serve-ray] {msg}", file=sys.stderr, flush=True)


def requests_of(args) -> list[str]:
    """--prompts distinct prompts, each --repeats times, shuffled with a fixed seed: the same list for every run."""
    prompts = [f"{BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]} (question {i})" for i in range(args.prompts)]
    order = [p for p in prompts for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(order)
    return order


def eos_ban(model_dir: str) -> dict[str, int]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    return {str(token): -100 for token in ([eos] if isinstance(eos, int) else eos or [])}


def send_all(url: str, model: str, order: list[str], clients: int, max_tokens: int, bias: dict) -> dict:
    """The requests through `clients` concurrent clients; wall time, tokens, replicas, latencies."""

    def send(prompt: str) -> tuple[int, str, float]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": bias}
        start = time.perf_counter()
        r = http.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], r.headers["x-weightstream-replica"], time.perf_counter() - start

    with httpx.Client(timeout=600) as http:  # one client, shared by the threads (httpx's is thread-safe)
        done, wall = run_clients(order, clients, send)
    answers = dict(enumerate(done))
    tokens = sum(a[0] for a in answers.values())
    return {
        "wall_s": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "requests_per_replica": dict(Counter(a[1] for a in answers.values())),
        "latency_s_p50": round(statistics.median(a[2] for a in answers.values()), 2),
    }


def ray_samples(metrics_url: str, name: str, app: str) -> dict[tuple[str, str], float]:
    """Samples named `name` of application `app` in Ray's metrics export: {(replica, reason): value}."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("application") == app:
                key = (sample.labels.get("replica", ""), sample.labels.get("reason", ""))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def replica_figures(metrics_url: str, app: str, tokens: int) -> dict:
    """The replicas' counters once Ray's export shows every generated token (it lags by its report interval)."""
    deadline = time.monotonic() + 60
    while True:
        generated = sum(ray_samples(metrics_url, "ray_weightstream_generation_tokens_total", app).values())
        if generated >= tokens or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    total = lambda name: sum(ray_samples(metrics_url, name, app).values())  # noqa: E731
    read = total("ray_weightstream_device_read_bytes_total")
    hits, misses = total("ray_weightstream_expert_hits_total"), total("ray_weightstream_expert_misses_total")
    decisions: Counter = Counter()
    for (_, reason), value in ray_samples(metrics_url, "ray_weightstream_router_decisions_total", app).items():
        decisions[reason] += int(value)
    return {
        "generated_tokens_in_metrics": generated,
        "device_bytes_read": read,
        "mib_read_per_token": round(read / 2**20 / max(generated, 1), 2),
        "expert_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "router_decisions": dict(decisions),
    }


def run_once(args, router: str, name: str, urls: dict, order: list[str]) -> dict:
    from ray import serve

    from weightstream.serve.ray.app import RayOptions, application

    engine = {"io_threads": args.io_threads, "expert_cache": args.expert_cache, "memory": args.memory}
    settings = ServeSettings(
        args.model, engine=engine, model_name="bench", routing_trace=args.trace, max_batch=args.max_batch
    )
    options = RayOptions(replicas=args.replicas, replica_cpus=args.replica_cpus, router=router)
    start = time.perf_counter()
    serve.run(application(settings, options), name=name, route_prefix=f"/{name}")
    say(f"{name}: {args.replicas} replicas ready in {time.perf_counter() - start:.1f} s")
    try:
        run = send_all(f"{urls['http']}/{name}", "bench", order, args.clients, args.max_tokens, eos_ban(args.model))
        run.update(replica_figures(urls["metrics"], name, run["completion_tokens"]))
    finally:
        serve.delete(name)
    say(f"{name}: {json.dumps(run)}")
    return run


def ratios(rounds: list[dict], key: str) -> dict:
    per_round = [r["expert-affinity"][key] / r["default"][key] for r in rounds if r["default"][key]]
    return {"per_round": [round(q, 3) for q in per_round], "median": round(statistics.median(per_round), 3)}


def simulate(argv: list[str], prog: str) -> None:
    import numpy as np

    from weightstream.cache.policy import LRUPolicy, access_layer
    from weightstream.engine.batching.replay import prompt_request
    from weightstream.engine.loader import load_tokenizer
    from weightstream.trace import load
    from weightstream.trace.remap import token_rows

    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("model")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--caches", default="1x,2x,4x", help="cache sizes as multiples of one token's experts")
    for flag, value in (("--replicas", 2), ("--prompts", 8), ("--repeats", 4), ("--max-tokens", 32), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=value)
    args = ap.parse_args(argv)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    layers, one_token = config["num_hidden_layers"], config["num_hidden_layers"] * config["num_experts_per_tok"]
    trace = load(args.trace)
    choices = token_rows(trace)  # [tokens, trace layers, k]
    token_start = np.concatenate([[0], np.cumsum(trace.step_tokens)])
    starts = [int(token_start[trace.first_step_of_request(r)]) for r in range(len(trace.requests))]
    tokenizer = load_tokenizer(args.model, required=True)
    order = requests_of(args)
    rows = {}
    for prompt in set(order):
        ids = tokenizer(prompt).input_ids
        first = starts[prompt_request(ids, len(starts))]
        rows[prompt] = (first + np.arange(len(ids) + args.max_tokens)) % len(choices)
    home = {p: i % args.replicas for i, p in enumerate(dict.fromkeys(order))}
    rng = random.Random(args.seed)
    spread = [rng.randrange(args.replicas) for _ in order]
    out = {}
    for cache in args.caches.split(","):
        slots = round(float(cache.rstrip("x")) * one_token)
        misses = {}
        for name, placed in (("by_prompt", [home[p] for p in order]), ("at_random", spread)):
            replicas = [LRUPolicy(slots) for _ in range(args.replicas)]
            count = 0
            for prompt, replica in zip(order, placed):
                for row in choices[rows[prompt]]:
                    for layer in range(layers):
                        count += len(access_layer(replicas[replica], layer, row[layer % row.shape[0]]).misses)
            misses[name] = round(count / (len(order) * args.max_tokens), 2)
        out[cache] = {**misses, "by_prompt_over_at_random": round(misses["by_prompt"] / misses["at_random"], 3)}
        say(f"simulate {cache} ({slots} slots a replica): misses a generated token {out[cache]}")
    print(json.dumps({"model": args.model, "trace": args.trace, "requests": len(order), "caches": out}, indent=2))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        return simulate(argv[1:], f"{prog or 'serve_ray'} simulate")
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--trace", help="routing trace to replay per prompt (the shared DeepSeek-V2-Lite); default: own")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--expert-cache", help="each replica's expert cache (default 2x)")
    size.add_argument("--memory", help="each replica's --memory instead")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts (default 8)")
    ap.add_argument("--repeats", type=int, default=4, help="times each prompt is sent (default 4)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default("serve-ray.json"))
    args = ap.parse_args(argv)
    args.expert_cache = args.expert_cache or (None if args.memory else "2x")

    import ray
    from ray import serve

    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    urls = {"http": f"http://127.0.0.1:{free_port()}"}
    metrics_port = free_port()
    ray.init(
        num_cpus=max(1, round(args.replicas * args.replica_cpus)),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        log_to_driver=False,
    )
    urls["metrics"] = f"http://127.0.0.1:{metrics_port}/metrics"
    order = requests_of(args)
    rounds = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(urls["http"].rsplit(":", 1)[1])})
        for r in range(args.rounds):
            routers = ROUTERS if r % 2 == 0 else ROUTERS[::-1]
            rounds.append({router: run_once(args, router, f"r{r}-{router}", urls, order) for router in routers})
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(block_device_of(args.model)),
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "model": args.model,
        "trace": args.trace,
        "replicas": args.replicas,
        "expert_cache": args.expert_cache,
        "memory": args.memory,
        "requests": len(order),
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "affinity_over_default": {
            "tokens_per_s": ratios(rounds, "tokens_per_s"),
            "mib_read_per_token": ratios(rounds, "mib_read_per_token"),
        },
    }
    emit(report, args.out, indent=2)
