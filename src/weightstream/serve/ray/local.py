"""`weightstream serve --ray`: start a Ray cluster on this machine (or join one with --ray-address), run the
application (app.py) behind Ray Serve's HTTP proxy, and serve until SIGTERM or Ctrl-C.

Shutdown: the application is deleted (each replica's graceful shutdown lets requests in flight finish within
--shutdown-grace, then closes its engine); then, on a cluster of its own, Ray's shutdown ends every process it
started (Serve's controller and proxy among them), and on a cluster it joined the cluster is left as it was.
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import threading
import time

import ray
from ray import serve

from weightstream.errors import WeightstreamError
from weightstream.serve.ray.app import RayOptions, application, logging_config
from weightstream.serve.server import EXIT_SIGNALS, bind
from weightstream.serve.service import ServeSettings

APP_NAME = "weightstream"


def say(message: str) -> None:
    print(f"weightstream serve --ray: {message}", file=sys.stderr, flush=True)


def serve_on_ray(
    settings: ServeSettings, options: RayOptions, host: str, port: int, address: str | None = None
) -> None:
    """Serve until SIGTERM or Ctrl-C (then KeyboardInterrupt, as `weightstream serve`)."""
    port = port or _free_port(host)
    bind(host, port).close()  # a port in use is the same clear error as without Ray, before Ray starts
    own_cluster = address is None
    stop, received = threading.Event(), []
    previous = {sig: signal.getsignal(sig) for sig in EXIT_SIGNALS}
    try:
        say(f"starting Ray ({'a local cluster' if own_cluster else address}) and {options.replicas} replica(s)")
        ray.init(address=address or "local", include_dashboard=False, namespace=APP_NAME, log_to_driver=True)
        _deploy(settings, options, host, port)  # Ctrl-C here is KeyboardInterrupt, SIGTERM Ray's exit: both stop
        for sig in EXIT_SIGNALS:
            signal.signal(sig, lambda s, _: (received.append(s), stop.set()))
        metrics_port = ray.nodes()[0].get("MetricsExportPort")
        where = f"http://{host}:{port}" if own_cluster else f"the cluster's Ray Serve HTTP proxy (here: {host}:{port})"
        say(
            f"listening on {where}; {options.replicas} replica(s) of {settings.model_name!r} ready, router "
            f"{options.router}; metrics: Ray's export (port {metrics_port} on each node, ray_weightstream_*)"
        )
        stop.wait()
    finally:
        _shut_down(own_cluster, settings.shutdown_grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt


def _deploy(settings: ServeSettings, options: RayOptions, host: str, port: int) -> None:
    serve.start(http_options={"host": host, "port": port}, logging_config=logging_config(options.log_level))
    try:
        serve.run(application(settings, options), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # a replica's constructor failed: Ray's message holds its traceback
        found = re.findall(r"WeightstreamError: (.+)", str(exc))
        raise WeightstreamError(found[-1] if found else f"the replicas did not start: {exc}") from None


def _delete_app(grace_s: float) -> None:
    """Delete the application and wait until its replicas are gone, looking every 0.1 s (serve.delete's own wait
    looks once a second): at most the replicas' grace and a margin."""
    serve.delete(APP_NAME, _blocking=False)
    deadline = time.monotonic() + grace_s + 30
    while APP_NAME in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.1)


def _shut_down(own_cluster: bool, grace_s: float) -> None:
    if not ray.is_initialized():
        return
    say("stopping: requests in flight finish within --shutdown-grace, then the replicas close their engines")
    try:
        # the application alone, on either cluster: its replicas' graceful shutdown; on a cluster of its own, Ray's
        # shutdown then ends the controller and the proxy with every other process (serve.shutdown() asked the
        # controller to stop itself, waited 5 s idle and had Ray warn of the call its exit cut: issue 52, case 14)
        _delete_app(grace_s)
    finally:
        ray.shutdown()
    say("stopped" + ("; Ray's processes have ended" if own_cluster else "; the cluster goes on"))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
