"""`weightstream serve` under concurrent clients: aggregate decode tokens/s, time per output token, device bytes
per token, and the expert union of batched steps, against the same requests sent one at a time in the same run.

For each routing (the model's own; a replayed trace with --routing-trace) and client count, a fresh server runs
inside a fresh memory cgroup (limit counts the page cache; default: model size / 2.75) after the model's pages
are dropped, so each phase starts as cold as the others. One warm-up request, then the phase: the same
--requests requests (distinct prompts, greedy, --max-tokens each), sent by that many concurrent streaming
clients. Phase 1 is sequential serving. Per phase: aggregate tokens/s (completion tokens / wall span), p50/p95
time per output token (per request, from the server's step log: (end of its last token's step - end of its
first's) / (tokens - 1)), block-device bytes read per generated token, and from the step log the decode steps'
union ratio (distinct experts per layer / (batch x top-k)): at 1 a step reads what its tokens would read one by
one. The ratio predicts bytes per token relative to sequential serving; the JSON puts the two side by side.

Prints one JSON object and writes it to --out. Needs root for the cgroup and the page-cache drop (--no-cgroup
runs without both, for a smoke test). Example:
    weightstream synth --preset olmoe-1b-7b --layers 16 --out models/olmoe-16l
    weightstream trace import --format moe-beyond-csv --model-shape deepseek-v2-lite -o ds.npz \\
        $(ls ../shared/traces/deepseek-v2-lite-chat/prompt_*_data.csv | sort -t_ -k3 -n)
    sudo .venv/bin/python benchmarks/serve_bench.py concurrency models/olmoe-16l --routing-trace ds.npz \\
        --expert-cache 1.5x --clients 1,4,8 --requests 16 --max-tokens 64 -o benchmarks/results/serve-olmoe16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from common.clients import run_clients, stderr_lines, wait_ready
from common.results import default, emit
from prometheus_client.parser import text_string_to_metric_families

from weightstream.bench.coldstart import drop_page_cache
from weightstream.bench.machine import block_device_of, device_bytes_read, machine_info
from weightstream.bench.prompts import BUILTIN_PROMPTS
from weightstream.bench.reclaim import paused_proactive_reclaim
from weightstream.cgroup import MemoryCgroup
from weightstream.store.checkpoint import open_checkpoint
from weightstream.units import parse_size

MODEL = "bench"


def say(msg: str) -> None:
    print(f"[serve bench] {msg}", file=sys.stderr, flush=True)


class Server:
    """A `weightstream serve` child (in `cgroup` when given) with its step log; `stop()` sends SIGTERM."""

    def __init__(self, args, routing_trace: str | None, cgroup: MemoryCgroup | None, step_log: str):
        cmd = [sys.executable, "-m", "weightstream.cli", "serve", args.model_dir, "--port", "0"]
        cmd += ["--served-model-name", MODEL, "--max-batch", str(max(args.clients)), "--kv-cache", args.kv_cache]
        cmd += ["--expert-cache", args.expert_cache, "--io-threads", str(args.io_threads), "--step-log", step_log]
        cmd += ["--routing-trace", routing_trace] if routing_trace else []
        cmd += ["--batch-beyond-cache"] if args.batch_beyond_cache else []
        spawn = cgroup.popen if cgroup is not None else subprocess.Popen
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines = stderr_lines(self.proc)
        self.url = wait_ready(self.proc, self.lines)
        if self.url is None:
            raise RuntimeError(f"server did not become ready:\n{''.join(self.lines)}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {name{labels}: value}."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=30).text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


def request(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: start, first-token and end times, tokens (from the usage chunk)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start, first, tokens, error = time.perf_counter(), None, 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            error = error or chunk.get("error")
            first = first or (time.perf_counter() if chunk.get("choices") else None)
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return {"start": start, "first": first, "end": time.perf_counter(), "tokens": tokens, "error": error}


def phase(server: Server, prompts: list[str], clients: int, max_tokens: int, device: str) -> dict:
    """All `prompts`, `clients` at a time; what the clients, the device and the server measured meanwhile."""
    before, dev0, t0 = server.metrics(), device_bytes_read(device), time.time()
    results, _ = run_clients(prompts, clients, lambda prompt: request(server.url, prompt, max_tokens))
    after, dev1, t1 = server.metrics(), device_bytes_read(device), time.time()
    return summarize(results, clients, before, after, (dev0, dev1), (t0, t1))


def summarize(results, clients, before, after, device, window) -> dict:
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    tokens = sum(r["tokens"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tpot = sorted((r["end"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1 and r["first"])
    choices = delta("weightstream_decode_expert_choices_total")
    device_bytes = device[1] - device[0] if None not in device else None
    return {
        "clients": clients,
        "requests": len(results),
        "errors": [r["error"] for r in results if r["error"]],
        "completion_tokens": tokens,
        "wall_s": span,
        "aggregate_tokens_per_s": tokens / span,
        # streamed text of random weights is often held back until it decodes cleanly, so these client-side
        # figures can read 0; `server_tpot_*` (from the step log, added by run_routing) are the token times
        "client_tpot_p50_s": statistics.median(tpot) if tpot else None,
        "client_tpot_p95_s": tpot[min(len(tpot) - 1, int(0.95 * len(tpot)))] if tpot else None,
        "decode_steps": delta("weightstream_decode_steps_total"),
        "mean_batch": delta("weightstream_decode_batch_size_sum")
        / max(delta("weightstream_decode_batch_size_count"), 1),
        "union_ratio": delta("weightstream_decode_distinct_experts_total") / choices if choices else None,
        "device_bytes_per_token": device_bytes / tokens if device_bytes is not None else None,
        "cache_bytes_read_per_token": delta("weightstream_device_read_bytes_total") / tokens,
        "window": window,
    }


def server_tpot(step_log: str, window: tuple[float, float]) -> dict:
    """Per sequence: (end of its last step - end of its first) / (steps - 1), from the step log, which names the
    sequences each step gave a token to; p50 and p95 over the window's sequences."""
    ends: dict[int, list[float]] = {}
    with open(step_log, encoding="utf-8") as f:
        for line in f:
            step = json.loads(line)
            if window[0] <= step["t"] <= window[1]:
                for seq in step.get("seqs", []):
                    ends.setdefault(seq, []).append(step["t"])
    tpot = sorted((t[-1] - t[0]) / (len(t) - 1) for t in ends.values() if len(t) > 1)
    if not tpot:
        return {"server_tpot_p50_s": None, "server_tpot_p95_s": None}
    return {
        "server_tpot_p50_s": statistics.median(tpot),
        "server_tpot_p95_s": tpot[min(len(tpot) - 1, int(0.95 * len(tpot)))],
    }


def union_by_batch(step_log: str, window: tuple[float, float]) -> dict[int, dict]:
    """Decode steps of the window grouped by batch size: steps, mean union ratio, bytes read per token."""
    groups: dict[int, list[dict]] = {}
    with open(step_log, encoding="utf-8") as f:
        for line in f:
            step = json.loads(line)
            if step["phase"] == "decode" and window[0] <= step["t"] <= window[1]:
                groups.setdefault(step["batch"], []).append(step)
    return {
        b: {
            "steps": len(steps),
            "union_ratio": statistics.fmean(s["union_ratio"] for s in steps),
            "distinct_per_layer": statistics.fmean(statistics.fmean(s["distinct_per_layer"]) for s in steps),
            "batch_x_top_k": statistics.fmean(s["choices_per_layer"][0] for s in steps),
            "bytes_read_per_token": sum(s["bytes_read"] for s in steps) / (b * len(steps)),
        }
        for b, steps in sorted(groups.items())
    }


def run_routing(args, routing_trace: str | None, files: list[str], device: str) -> dict:
    """A phase per client count, each on a fresh server in a fresh cgroup after the model's pages are dropped (so
    no phase inherits the expert cache or page cache an earlier one warmed), after one warm-up request."""
    prompts = [f"Request {i}: {BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]}" for i in range(args.requests)]
    phases, peaks, exits, cold = [], [], [], None
    with paused_proactive_reclaim():  # the limit alone decides what stays cached (bench.reclaim)
        for clients in args.clients:
            cold = drop_page_cache(files) if args.cgroup else None
            cgroup = MemoryCgroup.create(args.memory_limit) if args.cgroup else None
            step_log = tempfile.NamedTemporaryFile(prefix="serve-steps-", suffix=".jsonl", delete=False).name
            try:
                say(f"routing {routing_trace or 'model'}: starting a server for {clients} client(s)")
                server = Server(args, routing_trace, cgroup, step_log)
                try:
                    request(server.url, "warm-up", 4)  # first-call costs (JIT, allocator) stay out of the phase
                    say(f"routing {routing_trace or 'model'}: {args.requests} requests, {clients} concurrent client(s)")
                    p = phase(server, prompts, clients, args.max_tokens, device)
                    say(f"  {p['aggregate_tokens_per_s']:.2f} tok/s aggregate")
                finally:
                    exits.append(server.stop())
                window = tuple(p.pop("window"))
                p.update(server_tpot(step_log, window))
                p["by_batch"] = union_by_batch(step_log, window)
                phases.append(p)
                peaks.append(cgroup.peak_bytes if cgroup else None)
            finally:
                os.unlink(step_log)
                if cgroup is not None:
                    cgroup.remove()
    return {
        "routing": routing_trace or "model",
        "system_page_cache_dropped": cold,
        "peak_memory_bytes": peaks,
        "server_exits": exits,
        "phases": phases,
        "vs_sequential": versus_sequential(phases),
    }


def versus_sequential(phases: list[dict]) -> list[dict]:
    """Each phase against the 1-client phase: speed-up, and bytes per token measured vs predicted by the union.

    Two byte counts: the block device's (everything the disk read, meaningful on a quiet machine) and the expert
    cache's own (exactly the expert reads).
    """
    base = next((p for p in phases if p["clients"] == 1), None)
    if base is None:
        return []
    ratio = lambda p, key: p[key] / base[key] if p[key] is not None and base[key] else None  # noqa: E731
    return [
        {
            "clients": p["clients"],
            "speedup": ratio(p, "aggregate_tokens_per_s"),
            "device_bytes_per_token_ratio": ratio(p, "device_bytes_per_token"),
            "expert_bytes_per_token_ratio": ratio(p, "cache_bytes_read_per_token"),
            "union_ratio_predicts": ratio(p, "union_ratio"),
        }
        for p in phases
    ]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--routing-trace", help="also run with this trace's routing replayed (a .npz)")
    ap.add_argument("--clients", default="1,4,8", help="client counts, one phase each; 1 = sequential (default 1,4,8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per phase (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--expert-cache", default="1.5x")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--kv-cache", default="512MiB")
    ap.add_argument("--memory-limit", help="cgroup limit (default: model bytes / 2.75)")
    ap.add_argument("--no-cgroup", dest="cgroup", action="store_false", help="no cgroup, no cache drop (smoke test)")
    ap.add_argument(
        "--batch-beyond-cache",
        action="store_true",
        help="let batches outgrow the expert cache (serve's flag): shows what the cap avoids",
    )
    ap.add_argument("-o", "--out", default=default("serve.json"), help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    ckpt = open_checkpoint(args.model_dir)
    args.memory_limit = parse_size(args.memory_limit) if args.memory_limit else int(ckpt.total_bytes() / 2.75)
    device = block_device_of(args.model_dir)
    routings = [None] + ([args.routing_trace] if args.routing_trace else [])
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_info(device),
        "model": args.model_dir,
        "model_bytes": ckpt.total_bytes(),
        "memory_limit_bytes": args.memory_limit if args.cgroup else None,
        "expert_cache": args.expert_cache,
        "batch_beyond_cache": args.batch_beyond_cache,
        "runs": [run_routing(args, r, ckpt.files, device) for r in routings],
    }
    emit(result, args.out)
