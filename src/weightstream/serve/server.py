"""Run the server: bind the socket first (a port in use is a clear error, port 0 picks a free one), serve with
uvicorn while the model loads in the background, and shut down in order on SIGTERM or Ctrl-C.

Shutdown: the first signal stops admissions (new requests get 503) and gives requests in flight
`shutdown_grace_s` to finish; at the deadline the scheduler fails what is left (streams end with an error event).
uvicorn then closes the connections, and the lifespan's end stops the scheduler and the expert cache's I/O
threads. A second Ctrl-C skips the wait; the model is closed all the same.
"""

from __future__ import annotations

import signal
import socket
import sys

import uvicorn
from prometheus_client import disable_created_metrics

from weightstream.errors import WeightstreamError
from weightstream.serve.app import build_app
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.service import ModelService, ServeSettings


def say(message: str) -> None:
    print(f"weightstream serve: {message}", file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """uvicorn's server, which on the first exit signal also starts draining the scheduler."""

    def __init__(self, config: uvicorn.Config, service: ModelService):
        super().__init__(config)
        self.service = service
        self.exit_signal: int | None = None  # the first exit signal, which sets the command's exit status

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self.exit_signal = sig
            grace = self.service.settings.shutdown_grace_s
            if self.service.scheduler is not None:
                self.service.scheduler.drain(grace)
            say(f"{signal.Signals(sig).name}: finishing requests in flight (up to {grace:g} s), taking no new ones")
        super().handle_exit(sig, frame)


def serve(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve until SIGTERM or Ctrl-C; a model that fails to load raises its error here after the server stops."""
    disable_created_metrics()  # a *_created sample per series doubles /metrics and tells an operator nothing here
    metrics = ServeMetrics()
    sock = bind(host, port)
    server: _Server | None = None
    service = ModelService(settings, metrics, on_load_error=lambda: setattr(server, "should_exit", True))
    metrics.engine = service
    config = uvicorn.Config(
        build_app(service, metrics),
        log_level=log_level,
        timeout_graceful_shutdown=settings.shutdown_grace_s + 5,  # backstop: the scheduler ends streams at the grace
        lifespan="on",
    )
    server = _Server(config, service)
    service.on_ready = lambda: say(ready_line(service))
    bound_host, bound_port = sock.getsockname()[:2]
    say(f"listening on http://{bound_host}:{bound_port}; loading {settings.model_dir} (GET /health is 503 until ready)")
    # uvicorn re-raises the signal it handled once it has shut down, and whether asyncio's own Ctrl-C handler then
    # turns that into KeyboardInterrupt depends on timing (CI saw exit 0 after Ctrl-C). So our handlers stand
    # under uvicorn's, ignore the re-raised signal, and the exit status comes from the signal recorded below.
    previous = {sig: signal.signal(sig, lambda s, frame: _after_uvicorn(server, s)) for sig in EXIT_SIGNALS}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        service.close()
        sock.close()
        say(stopped_line(metrics))
    if service.error is not None:
        raise service.error
    if server.exit_signal == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C: the CLI's "interrupted" status (130); after a clean shutdown SIGTERM is 0


EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _after_uvicorn(server: _Server, sig: int) -> None:
    if not server.should_exit:  # a signal before uvicorn took over: end now, the finally clause closes the model
        raise SystemExit(128 + sig)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise WeightstreamError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); choose another --port "
            "(0 picks a free one) or stop what uses it"
        ) from None
    sock.set_inheritable(True)
    return sock


def ready_line(service: ModelService) -> str:
    mib = 2**20
    cache = service.model.weightstream.cache
    kv = service.settings.kv_budget_bytes
    return (
        f"ready: model {service.model_name!r}, expert cache {cache.memory_bytes / mib:.0f} MiB, KV budget "
        f"{kv / mib:.0f} MiB ({kv // service.kv_bytes_per_token} positions of {service.kv_bytes_per_token} bytes), "
        f"max batch {service.settings.max_batch}, context {service.max_model_len} tokens"
        + (f", prefill {chunk} tokens a forward" if (chunk := service.settings.prefill_chunk) else "")
    )


def stopped_line(metrics: ServeMetrics) -> str:
    o = metrics.outcomes
    finished = o["stop"] + o["length"]
    return (
        f"stopped: {finished} requests finished, {o['cancelled']} cancelled by their clients, {o['shutdown']} ended "
        f"by the shutdown, {o['failed']} failed; scheduler and I/O threads stopped"
    )
