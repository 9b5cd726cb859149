"""`weightstream serve` against `llama-server` on the same GGUF file, every weight resident, with concurrent clients:
aggregate completion tokens a second for the same greedy requests, back to back.

Each round starts llama.cpp's server (`llama-server -m FILE -np CLIENTS --no-repack -t THREADS`: CLIENTS parallel
slots, continuous batching, its repacked path off as on MoE files it asserts) and, in turn, ours on the file's
import (`weightstream serve IMPORTED --expert-cache 100x --max-batch CLIENTS`: a cache for every expert), the order
alternating between rounds (these machines drift by 15-25% over minutes). Against each server: one warm-up request
(every built-in prompt twice, about 210 tokens, which routes to nearly every expert and so fills our cache), then
--requests distinct prompts (the built-in ones, numbered), greedy, --max-tokens each, sent by CLIENTS concurrent
clients; aggregate tok/s = completion tokens / wall time of the phase. llama-server is asked to ignore its
end-of-text token (our random-weight models rarely emit one; tokens are counted either way). Medians and the
spread of the rounds; the ratio is ours / llama.cpp's per round.

    .venv/bin/python benchmarks/llamacpp.py serve FILE.gguf IMPORTED_DIR [--clients 8] [--requests 16]
        [--max-tokens 64] [--rounds 4] [--threads 2] [--out benchmarks/results/serve-vs-llamacpp.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import httpx
import llamacpp
from common.clients import free_port, run_clients, stderr_lines, wait_ready
from common.results import default, emit
from common.rounds import against_llamacpp, alternated, head

from weightstream.bench.prompts import BUILTIN_PROMPTS

MODEL = "bench"


def say(msg: str) -> None:
    print(f"[serve-vs-llama.cpp] {msg}", file=sys.stderr, flush=True)


class Child:
    """A server process; `url` once its /health answers 200, its stderr kept for errors."""

    def __init__(self, cmd: list[str], url: str | None, env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines = stderr_lines(self.proc)
        self.url = wait_ready(self.proc, self.lines, url)  # ours (url None) says where it listens
        if self.url is None:
            self.stop()
            raise SystemExit(f"{cmd[0]} did not become ready:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def complete(url: str, prompt: str, max_tokens: int, extra: dict) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=None)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def phase(url: str, prompts: list[str], clients: int, max_tokens: int, extra: dict) -> dict:
    try:
        tokens, wall = run_clients(prompts, clients, lambda prompt: complete(url, prompt, max_tokens, extra))
    except httpx.HTTPError as e:
        raise SystemExit(f"{url}: a request failed: {e}") from e
    return {"completion_tokens": sum(tokens), "wall_s": wall, "aggregate_tokens_per_s": sum(tokens) / wall}


def run(who: str, args, prompts: list[str]) -> dict:
    if who == "llama.cpp":
        port = free_port()
        cmd = [str(llamacpp.tool("llama-server")), "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-np", str(args.clients), "-c", str(args.clients * args.context), "-t", str(args.threads)]
        cmd += ["--no-repack", "--no-webui"]
        server, extra = Child(cmd, f"http://127.0.0.1:{port}"), {"ignore_eos": True}
    else:
        cmd = [sys.executable, "-m", "weightstream.cli", "serve", args.imported, "--port", "0"]
        cmd += ["--served-model-name", MODEL, "--max-batch", str(args.clients), "--expert-cache", "100x"]
        env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
        server, extra = Child(cmd, None, env), {}
    try:
        complete(server.url, " ".join(BUILTIN_PROMPTS * 2), 4, extra)
        return phase(server.url, prompts, args.clients, args.max_tokens, extra)
    finally:
        server.stop()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="llama.cpp's file")
    ap.add_argument("imported", help="`weightstream import` of it")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients and llama-server slots (default 8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per phase (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--context", type=int, default=512, help="llama-server context per slot (default 512)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=default("serve-vs-llamacpp.json"))
    args = ap.parse_args(argv)
    if llamacpp.tool("llama-server") is None:
        raise SystemExit("llama-server could not be built here (see above)")
    prompts = [f"Request {i}: {BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]}" for i in range(args.requests)]
    runs = alternated(
        args.rounds,
        {who: lambda who=who: run(who, args, prompts) for who in ("llama.cpp", "weightstream")},
        lambda r, who, got: say(
            f"round {r} {who}: {got['aggregate_tokens_per_s']:.1f} tok/s ({got['completion_tokens']} tokens)"
        ),
    )
    report = head(
        args.gguf, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens, threads=args.threads
    )
    emit(against_llamacpp(report, runs, "aggregate_tokens_per_s", "median_tokens_per_s", True), args.out)
