"""`weightstream serve` as Ray Serve replicas, routed by the experts they hold. Optional: `pip install
'weightstream[ray]'`; nothing in the core imports this package.

- app: the application (one ingress, N engine replicas, the request router) from ServeSettings and RayOptions;
- ingress: the HTTP entry point: OpenAI's API forwarded to a replica, a replica's death turned into an error object;
- replica: one full engine (serve's ModelService) answering forwarded requests with serve's own HTTP app;
- forward: a request as the ingress forwards it, and serve's HTTP app run on it inside a replica;
- router: the expert-affinity request router (Ray Serve's RequestRouter);
- metrics: a replica's Prometheus metrics mirrored into Ray's metrics export;
- local: `weightstream serve --ray`: a local Ray cluster (or an existing one), the application, shutdown.
"""

from __future__ import annotations

from weightstream.errors import WeightstreamError

RAY_EXTRA = "pip install 'weightstream[ray]'"


def require_ray() -> None:
    """Ray Serve with custom request routers (Ray >= 2.46), or a WeightstreamError that says how to get it."""
    try:
        import ray  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError as exc:
        raise WeightstreamError(
            f"serving on Ray needs Ray Serve 2.46 or later, with its custom request routers ({exc}); install it "
            f"with {RAY_EXTRA}"
        ) from None


require_ray()
