"""`weightstream serve`: an OpenAI-compatible HTTP server over the streaming engine, with batched decode."""

from __future__ import annotations

import argparse
import os
import sys

from weightstream.commands.common import (
    add_engine_options,
    add_prefill_chunk_option,
    add_shard_options,
    engine_config,
    miss_copy_note,
    prefill_chunk_of,
    ray_for_shards,
    shard_options,
)
from weightstream.errors import WeightstreamError

API_KEY_ENV = "WEIGHTSTREAM_API_KEY"


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API, decoding concurrent requests together",
        description="Serve a Mixture-of-Experts checkpoint with experts streamed from disk: POST /v1/completions and "
        "/v1/chat/completions (streaming or not), GET /v1/models, /health and /metrics (Prometheus). "
        "Concurrent requests decode together, one forward per step, so each layer reads the union of the "
        "batch's experts once. Greedy output (temperature 0) equals `weightstream generate` given the same --memory "
        "or --prefill-chunk.",
        epilog="examples:\n  weightstream serve models/olmoe-4l --expert-cache 2x --port 8000\n"
        "  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        '       -d \'{"model": "olmoe-4l", "prompt": "Hello", "max_tokens": 16, "temperature": 0}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_DIR", help="model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)",
    )
    p.add_argument(
        "--served-model-name", metavar="NAME", help="the model name clients send (default: the directory's name)"
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="sequences decoded together (default 8); with an expert cache smaller than the model, fewer: a "
        "sequence joins only while the batch's measured expert union fits the cache, since a batch that does not "
        "rereads most of its experts every step",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=128,
        metavar="N",
        help="requests that may wait for a place in the batch (default 128); beyond them a request gets HTTP 429 "
        "with Retry-After at once",
    )
    p.add_argument(
        "--batch-beyond-cache",
        action="store_true",
        help="batch up to --max-batch even when the batch's experts overflow the expert cache",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context length: prompt + max_tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--kv-cache",
        default="1GiB",
        metavar="SIZE",
        help="KV cache budget of the running batch; requests that would exceed it wait, and when running ones grow "
        "past it the newest goes back to wait (default 1GiB)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, time requests in flight get to finish before they are ended (default 10)",
    )
    p.add_argument(
        "--routing-trace",
        metavar="TRACE.npz",
        help="benchmarks: replay this routing trace instead of the router (each request replays its own part of "
        "it); reads and compute are real, the text is meaningless",
    )
    p.add_argument("--step-log", metavar="FILE.jsonl", help="append one JSON line per forward step (benchmarks)")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="uvicorn's log level (with --ray: Ray Serve's, per-request logs at debug)",
    )
    add_engine_options(p)
    add_prefill_chunk_option(p)
    add_shard_options(p, ray_address=False)  # --ray-address is the Ray group's: with --expert-shards it places them
    add_ray_options(p)
    p.set_defaults(func=run)


def add_ray_options(p) -> None:
    ray = p.add_argument_group(
        "Ray Serve (pip install 'weightstream[ray]'; docs/serving.md, 'Beyond one machine')",
        "the same API from N replicas, each a full engine with its own --expert-cache or --memory, behind Ray "
        "Serve's HTTP proxy on --host/--port, routed to the replica whose cache holds the request's experts",
    )
    ray.add_argument("--ray", action="store_true", help="serve as Ray Serve replicas (a local cluster by default)")
    ray.add_argument("--replicas", type=int, metavar="N", help="--ray: engine replicas (default 2)")
    ray.add_argument(
        "--replica-cpus",
        type=float,
        metavar="N",
        help="--ray: Ray CPUs per replica, and its torch threads (default 1)",
    )
    ray.add_argument(
        "--router",
        choices=("expert-affinity", "default"),
        help="--ray: expert-affinity (default): the replica holding the prompt's prefill experts, else the least "
        "loaded; default: Ray Serve's own (power of two choices), for comparison",
    )
    ray.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="--ray: join this running Ray cluster (e.g. auto, or HEAD:6379) instead of starting one; on exit only "
        "this application is deleted. With --expert-shards: the cluster the shards are placed on",
    )
    ray.add_argument(
        "--max-ongoing-requests",
        type=int,
        metavar="N",
        help="--ray: requests one replica holds at once (default twice --max-batch); more wait in Ray's router",
    )


RAY_ONLY = ("replicas", "replica_cpus", "router", "ray_address", "max_ongoing_requests")


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise WeightstreamError(f"--port {args.port}: must be 0..65535")
    settings = _settings(args)
    if args.ray:
        from weightstream.serve.ray.local import serve_on_ray

        serve_on_ray(settings, _ray_options(args), args.host, args.port, args.ray_address)
        return 0
    from weightstream.serve.server import serve

    with ray_for_shards(settings.shards):
        serve(settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def ray_app(args: dict):
    """Ray Serve's application builder: `serve run weightstream.commands.serve:ray_app model=MODEL replicas=2
    expert_cache=2x` (or `import_path` and `args` in a `serve deploy` config). Keys are serve's options with
    underscores; a flag takes true; Ray Serve's own `serve run` starts or joins the cluster."""
    argv = [str(args.get("model", ""))]
    for key, value in args.items():
        if key == "model":
            continue
        flag, text = f"--{key.replace('_', '-')}", str(value)
        if text.lower() in ("true", "false"):
            argv += [flag] if text.lower() == "true" else []
        else:
            argv += [flag, text]
    parser = argparse.ArgumentParser(prog="weightstream serve (ray_app)")
    register(parser.add_subparsers())
    parsed = parser.parse_args(["serve", *argv, "--ray"])
    from weightstream.serve.ray.app import application

    return application(_settings(parsed), _ray_options(parsed))


def _settings(args):
    """ServeSettings from serve's options, checked (the model found, Ray's options only with --ray)."""
    from weightstream.store.model_dir import resolve_model

    shards = shard_options(args)
    given = [name for name in RAY_ONLY if getattr(args, name) is not None]
    if shards is not None and given == ["ray_address"]:
        given = []  # without --ray it is the cluster the shards are placed on
    if given and not args.ray:
        raise WeightstreamError(f"--{given[0].replace('_', '-')} goes with --ray; add --ray or leave it out")
    if args.ray and args.step_log:
        raise WeightstreamError("--step-log writes one process's steps; with --ray read the replicas' metrics instead")
    if args.ray:
        from weightstream.serve.ray import require_ray

        require_ray()  # before the model is looked for or anything loads: a missing extra is one line naming it
    model_dir = resolve_model(args.model)  # before the server's imports (torch, transformers: seconds)
    if args.miss_copy:
        print(miss_copy_note("serve"), file=sys.stderr)
    from weightstream.serve.service import ServeSettings

    return ServeSettings(
        model_dir=model_dir,
        engine=engine_config(args),
        model_name=args.served_model_name or _default_name(args.model),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        batch_beyond_cache=args.batch_beyond_cache,
        max_model_len=args.max_model_len,
        kv_cache=args.kv_cache,
        prefill_chunk=prefill_chunk_of(args),
        api_key=args.api_key or None,
        shutdown_grace_s=args.shutdown_grace,
        routing_trace=args.routing_trace,
        step_log=args.step_log,
        shards=shards,
    )


def _ray_options(args):
    from weightstream.serve.ray.app import RayOptions

    return RayOptions(
        replicas=2 if args.replicas is None else args.replicas,
        replica_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
        router=args.router or "expert-affinity",
        max_ongoing_requests=args.max_ongoing_requests,
        log_level=args.log_level,
    )


def _default_name(model: str) -> str:
    """A directory's name, or the Hugging Face id as given."""
    return model if not os.path.isdir(model) else os.path.basename(os.path.normpath(model))
