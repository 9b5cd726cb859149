"""The HTTP entry point on Ray: every route of `weightstream serve`'s API forwarded whole to one engine replica, chosen
by the deployment's request router (router.py) from the request's affinity key, and the replica's answer passed back
as it comes (a stream stays a stream).

A replica that dies with a request in flight cannot answer it: before the answer has started the client gets a 503
error object (Retry-After: 1; OpenAI's clients retry it, and the router sends the retry to a live replica), after it
has started a stream ends with an error event, as serve ends a stream its shutdown cuts. Ray Serve starts a new
replica in the dead one's place; requests on the others go on.
"""

from __future__ import annotations

import json
import sys

from ray import serve
from ray.exceptions import RayActorError, RayError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from weightstream.serve.affinity import affinity_key
from weightstream.serve.app import MAX_BODY_BYTES
from weightstream.serve.protocol import ApiError
from weightstream.serve.ray.forward import ForwardedRequest, ResponseStart

METRICS_NOTE = (
    "GET /metrics: under Ray each replica's metrics go to Ray's metrics export (every Ray node serves them for "
    "Prometheus at its metrics export port, named ray_weightstream_*, tagged by replica), with the router's "
    "decisions as ray_weightstream_router_decisions_total; scrape those"
)


@serve.ingress()
class WeightstreamIngress:
    """Forwards each request to the engine replicas' deployment (`replicas`, a DeploymentHandle)."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.forward, methods=["POST"]),
            Route("/v1/chat/completions", self.forward, methods=["POST"]),
            Route("/v1/models", self.forward, methods=["GET"]),
            Route("/health", self.forward, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes)

    async def metrics(self, request: Request) -> Response:
        return _error(ApiError(404, METRICS_NOTE, code="metrics_in_ray"))

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(
                ApiError(413, f"the request body exceeds {MAX_BODY_BYTES // 2**20} MiB; send a shorter prompt")
            )
        call = ForwardedRequest(
            request.method,
            _route_path(request),
            request.url.query.encode(),
            tuple(request.headers.items()),
            body,
            affinity_key(body) if request.method == "POST" else None,
        )
        answer = self.replicas.handle.remote(call)
        try:
            start = await answer.__anext__()
        except RayError as exc:
            answer.cancel()
            return _error(_replica_error(exc))
        assert isinstance(start, ResponseStart), start
        headers = {k: v for k, v in start.headers if k.lower() != "content-length"}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_events(answer), start.status, headers)
        try:
            content = b"".join([chunk async for chunk in answer])
        except RayError as exc:
            return _error(_replica_error(exc))
        return Response(content, start.status, headers)


def _route_path(request: Request) -> str:
    """The path under the application's route prefix (Ray Serve passes the prefix as root_path)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _events(answer):
    """A replica's stream; if the replica dies mid-stream, an error event ends it (the OpenAI client raises it)."""
    try:
        async for chunk in answer:
            yield chunk
    except RayError as exc:
        yield f"data: {json.dumps(_replica_error(exc).body())}\n\n"
    finally:
        answer.cancel()  # no-op once finished; a client gone mid-stream cancels its request on the replica


def _replica_error(exc: RayError) -> ApiError:
    if isinstance(exc, RayActorError):
        return ApiError(
            503,
            "the replica serving this request stopped before it finished (Ray Serve starts a new one in its place); "
            "retry the request: the router sends it to a live replica",
            code="replica_died",
            headers={"Retry-After": "1"},
        )
    print(f"weightstream ray ingress: a replica failed: {exc}", file=sys.stderr)
    return ApiError(500, f"a replica failed on this request: {type(exc).__name__}; see the replica's log", code=None)


def _error(exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
