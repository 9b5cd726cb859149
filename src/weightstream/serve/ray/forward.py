"""A request as the ingress forwards it to a replica, and serve's HTTP app (serve/app.py) run on it there, in
process, as an ASGI server would run it: the replica answers with exactly what `weightstream serve` answers (status,
headers, body or server-sent events), so the API is one implementation whether or not Ray is in front of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from weightstream.serve.affinity import AFFINITY_HEADER

REPLICA_HEADER = "x-weightstream-replica"  # which replica answered (Ray Serve's replica id), on every answer


@dataclass(slots=True, frozen=True)
class ForwardedRequest:
    """One HTTP request, whole, and the affinity key the router reads (serve/affinity.py)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[str, str], ...]
    body: bytes
    affinity_key: str | None = None


@dataclass(slots=True, frozen=True)
class ResponseStart:
    """The status and headers of an answer; its body follows as bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]


def _scope(request: ForwardedRequest) -> dict:
    headers = [(k.lower(), v) for k, v in request.headers if k.lower() != AFFINITY_HEADER]  # only the ingress sets it
    if request.affinity_key:
        headers.append((AFFINITY_HEADER, request.affinity_key))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": None,
        "server": None,
    }


async def run_app(app, request: ForwardedRequest, extra_headers=()) -> AsyncIterator[ResponseStart | bytes]:
    """`app`'s answer to `request`: a ResponseStart (with `extra_headers` added), then body chunks. Closing the
    iterator early is the client going away: the app sees http.disconnect and its request is cancelled."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> dict:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(_scope(request), receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the app returned, or raised: nothing more comes
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"])
                yield ResponseStart(message["status"], headers + tuple(extra_headers))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task  # its own errors are the replica's errors
    finally:
        if not task.done():
            gone.set()
            task.cancel()
