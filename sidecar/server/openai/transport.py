"""What every HTTP route shares: the caller dependency, the SSE response, common headers.

The app keeps its collaborators on ``app.state`` (``service``: the ``InferenceService``,
``settings``: ``HttpSettings``); routes reach them through these dependencies.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from sidecar.server.service import Caller

CACHE_HEADER = "x-sidecar-cache"
# What a handler returns when the client left before the answer was ready: nobody reads it.
CLIENT_CLOSED = 499


class EventStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends.

    Starlette closes the body iterator on disconnect, but an iterator that never
    started has no ``finally`` to run; this hook covers that case too.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def stream_headers(rid: str, cache: str) -> dict:
    return {CACHE_HEADER: cache, "x-request-id": rid, "cache-control": "no-cache", "x-accel-buffering": "no"}


def service_of(request: Request) -> Any:
    return request.app.state.service


def caller_dependency(method: str) -> Callable[[Request], Caller]:
    """Dependency: count the call, then authenticate. Dependencies run before body validation, so
    refused requests are counted too (as the gRPC adapter counts them)."""

    def dependency(request: Request) -> Caller:
        request.app.state.settings.count_request(method)
        peer = request.client.host if request.client else ""
        return service_of(request).authenticate(request.headers.get("authorization"), peer)

    return dependency
