"""The Ray Serve application: one ingress (the HTTP entry point, no CPU of its own) in front of N engine replicas,
each a full `weightstream serve` engine with its own expert cache, routed by expert affinity or by Ray Serve's
default router (power of two choices). Deploy it from Python:

    from ray import serve
    from weightstream.serve.service import ServeSettings
    from weightstream.serve.ray.app import RayOptions, application

    settings = ServeSettings("models/olmoe-4l", engine={"expert_cache": "2x"})
    serve.run(application(settings, RayOptions(replicas=2)), name="weightstream", route_prefix="/")

or with `weightstream serve MODEL --ray --replicas N` (local.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ray import serve
from ray.serve.config import RequestRouterConfig

from weightstream.errors import WeightstreamError
from weightstream.serve.ray.ingress import WeightstreamIngress
from weightstream.serve.ray.replica import WeightstreamReplica
from weightstream.serve.ray.router import ExpertAffinityRouter
from weightstream.serve.service import ServeSettings

ROUTERS = ("expert-affinity", "default")
REPLICA_DEPLOYMENT = "weightstream-replica"
INGRESS_DEPLOYMENT = "weightstream-ingress"


@dataclass(slots=True)
class RayOptions:
    """How the engine is spread over Ray: replicas, each one's CPUs, the router and its knobs."""

    replicas: int = 2
    replica_cpus: float = 1.0  # Ray CPUs per replica; torch uses as many threads (at least 1)
    router: str = "expert-affinity"
    max_ongoing_requests: int | None = None  # per replica (default: twice --max-batch); beyond, requests wait in Ray
    imbalance: int = 2  # affinity yields to the least loaded replica beyond this many more ongoing requests
    stats_period_s: float = 1.0  # how often replicas report their experts to the router
    log_level: str = "warning"  # Ray Serve's logs of the deployments (access logs only at debug)

    def __post_init__(self):
        if self.replicas < 1:
            raise WeightstreamError(f"--replicas {self.replicas}: must be at least 1")
        if not self.replica_cpus > 0:
            raise WeightstreamError(f"--replica-cpus {self.replica_cpus}: must be more than 0")
        if self.router not in ROUTERS:
            raise WeightstreamError(f"--router {self.router}: choose one of {', '.join(ROUTERS)}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise WeightstreamError(f"--max-ongoing-requests {self.max_ongoing_requests}: must be at least 1")


def application(settings: ServeSettings, options: RayOptions):
    """The bound application: `serve.run` it."""
    settings = replace(settings, expert_affinity=True, replay_by_prompt=True)
    replicas = serve.deployment(
        WeightstreamReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing_requests or 2 * settings.max_batch,
        ray_actor_options={"num_cpus": options.replica_cpus},
        request_router_config=_router_config(options),
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=settings.shutdown_grace_s,
        graceful_shutdown_wait_loop_s=0.25,  # how often a stopping replica looks for requests in flight (Ray: 2 s)
        logging_config=logging_config(options.log_level),
    )
    ingress = serve.deployment(
        WeightstreamIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=10_000,  # it only forwards; the replicas' bound is the one that counts
        ray_actor_options={"num_cpus": 0},
        logging_config=logging_config(options.log_level),
    )
    return ingress.bind(replicas.bind(settings, max(1, math.floor(options.replica_cpus))))


def logging_config(level: str) -> dict:
    """Ray Serve's LoggingConfig for `level` (serve's --log-level): per-request access logs only at debug."""
    return {"log_level": level.upper(), "enable_access_log": level == "debug"}


def _router_config(options: RayOptions) -> RequestRouterConfig:
    period = {"request_routing_stats_period_s": options.stats_period_s}
    if options.router == "default":
        return RequestRouterConfig(**period)
    return RequestRouterConfig(
        request_router_class=ExpertAffinityRouter,
        request_router_kwargs={"imbalance": options.imbalance},
        **period,
    )
