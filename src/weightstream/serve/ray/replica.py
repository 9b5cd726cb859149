"""One engine replica on Ray: serve's ModelService (the model, its expert cache under its own --memory or
--expert-cache, the scheduler) and serve's HTTP app, answering the requests the ingress forwards. It reports to the
router the experts its prompts' prefills chose and the experts its cache holds (serve/affinity.py), tells Ray
Serve it is unhealthy when its scheduler has stopped (Ray then replaces it), and mirrors its metrics into Ray's."""

from __future__ import annotations

import torch
from prometheus_client import disable_created_metrics
from ray import serve

from weightstream.serve.app import build_app
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.ray.forward import REPLICA_HEADER, ForwardedRequest, run_app
from weightstream.serve.ray.metrics import RayMetricsMirror
from weightstream.serve.service import ModelService, ServeSettings


class WeightstreamReplica:
    """Loads the model in its constructor (Ray Serve counts the replica as starting until it returns)."""

    def __init__(self, settings: ServeSettings, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)  # as many as the CPUs Ray gave it: replicas on one node do not contend
        disable_created_metrics()
        self.metrics = ServeMetrics()
        self.service = ModelService(settings, self.metrics)
        self.metrics.engine = self.service
        self.service.load()
        self.app = build_app(self.service, self.metrics)  # its lifespan (which loads) is not run: loaded above
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.mirror = RayMetricsMirror(self.metrics.registry)
        self.mirror.start()

    async def handle(self, request: ForwardedRequest):
        """The answer of serve's app to `request`: a ResponseStart, then body chunks (a streaming handle call)."""
        async for part in run_app(self.app, request, [(REPLICA_HEADER, self.replica_id)]):
            yield part

    def record_routing_stats(self) -> dict:
        """Ray Serve asks every request_routing_stats_period_s; its router reads the answer (router.py)."""
        affinity = self.service.affinity
        return affinity.report() if affinity is not None else {}

    def check_health(self) -> None:
        scheduler = self.service.scheduler
        if self.service.closed or scheduler is None or not scheduler.alive:
            raise RuntimeError(f"replica {self.replica_id}: its scheduler has stopped; Ray Serve replaces it")

    def __del__(self):
        """Ray Serve's graceful shutdown: fail what is in flight, stop the scheduler and the I/O threads."""
        if hasattr(self, "mirror"):
            self.mirror.stop()
        if hasattr(self, "service"):
            self.service.close()
