"""The HTTP API (Starlette): OpenAI-style completions and chat completions, models, health and metrics.

Every error is an OpenAI error object with a 4xx/5xx status, and nothing about it reaches the scheduler; an
unexpected exception (a bug) is one too, a 500, with its traceback in the log. A
streamed answer is server-sent events ending in `data: [DONE]`; when its client disconnects, Starlette cancels
the stream and the sequence is cancelled with it (it leaves the batch at the next step boundary).
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from weightstream.engine.batching.sequence import Failed
from weightstream.serve.affinity import AFFINITY_HEADER
from weightstream.serve.metrics import ServeMetrics
from weightstream.serve.protocol import ApiError, ChatRequest, CompletionRequest, Reply, parse_request, sse
from weightstream.serve.service import ModelService

CLIENT_CLOSED = 499  # nginx's status for "the client went away first"; nobody receives it, the metrics count it
MAX_BODY_BYTES = 16 * 2**20  # far above any prompt a context holds; a bigger body is refused before it is kept


def build_app(service: ModelService, metrics: ServeMetrics) -> Starlette:
    """The ASGI app; its lifespan starts loading the model and, at shutdown, closes it."""
    api = _Api(service, metrics)

    @asynccontextmanager
    async def lifespan(app):
        service.start_loading()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.close)

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.counted("models", api.models), methods=["GET"]),
        Route("/v1/completions", api.counted("completions", api.completions), methods=["POST"]),
        Route("/v1/chat/completions", api.counted("chat", api.chat), methods=["POST"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


class _Api:
    def __init__(self, service: ModelService, metrics: ServeMetrics):
        self.service, self.stats = service, metrics

    def counted(self, endpoint: str, handler):
        async def run(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as exc:
                response = _api_error(request, exc)
            except Exception as exc:  # a bug, not the client's doing: it still gets an error object
                print(f"weightstream serve: {request.method} {request.url.path} failed:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                message = (
                    f"internal error: {type(exc).__name__}: {exc}; this is a bug in weightstream serve: please report "
                    "it with the request that caused it"
                )
                response = _api_error(request, ApiError(500, message))
            self.stats.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return run

    async def health(self, request: Request) -> Response:
        if self.service.ready:
            return JSONResponse({"status": "ok", "model": self.service.model_name})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self._check(request)
        entry = {
            "id": self.service.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "weightstream",
            "max_model_len": self.service.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest)

    def _check(self, request: Request) -> None:
        key = self.service.settings.api_key
        if key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server was "
                    "started with (--api-key)",
                    code="invalid_api_key",
                )
        if not self.service.ready:
            raise ApiError(503, "the model is still loading; retry when GET /health says ok", code="loading")

    async def _generate(self, request: Request, kind) -> Response:
        self._check(request)
        body = parse_request(await _read_body(request), kind)
        if body.model != self.service.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist here; this server serves {self.service.model_name!r} "
                "(GET /v1/models)",
                "model",
                "model_not_found",
            )
        prompts = self.service.prompts(body)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        seqs = self.service.sequences(body, prompts, lambda index: _emitter(loop, events, index))
        self.service.submit(seqs, request.headers.get(AFFINITY_HEADER))
        reply = self.service.reply(body, prompts)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = _stream(seqs, events, reply, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(request, seqs, events, reply)


async def _read_body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES whether or not Content-Length says so."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body exceeds {MAX_BODY_BYTES // 2**20} MiB; send a shorter prompt")
        chunks.append(chunk)
    return b"".join(chunks)


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """Scheduler thread -> this request's queue on the event loop, as (choice index, event)."""

    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the loop has closed (server exiting): nobody is listening any more
            pass

    return emit


async def _stream(seqs, events: asyncio.Queue, reply: Reply, include_usage: bool):
    try:
        for chunk in reply.opening():
            yield sse(chunk)
        while not reply.complete:
            index, event = await events.get()
            if isinstance(event, Failed):  # an error event, as OpenAI sends mid-stream; the client raises it
                yield sse(ApiError(event.status, event.message).body())
                return
            for chunk in reply.take(index, event):
                yield sse(chunk)
        if include_usage:
            yield sse(reply.usage_chunk())
        yield sse("[DONE]")
    finally:
        for seq in seqs:
            seq.cancel()  # no-op once finished; a client gone mid-stream frees their places at the next step


async def _whole(request: Request, seqs, events: asyncio.Queue, reply: Reply) -> Response:
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while not reply.complete:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return Response(status_code=CLIENT_CLOSED)
            index, event = get.result()
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            reply.take(index, event, stream=False)
        return JSONResponse(reply.whole())
    finally:
        gone.cancel()
        for seq in seqs:
            seq.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse(
        ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body(), exc.status_code
    )
