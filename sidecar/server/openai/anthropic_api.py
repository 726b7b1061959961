"""Route of the Anthropic Messages API: ``POST /v1/messages`` on the same service path.

The key comes in ``x-api-key`` (as Anthropic's clients send it) or ``Authorization: Bearer``.
Errors, before or during a stream, are in Anthropic's shape (``errors.ANTHROPIC_PREFIX``). One
message is one engine request run by a ``ChoiceRunner``, aborted and freed however the call ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sidecar.server.openai import format as fmt
from sidecar.server.openai.anthropic import (
    MessageBuilder,
    MessagesRequest,
    generation_request,
    new_id,
    sse_event,
)
from sidecar.server.openai.errors import anthropic_error_body, service_error_body
from sidecar.server.openai.runner import ChoiceRunner, first_events, guard_disconnect
from sidecar.server.openai.transport import (
    CACHE_HEADER,
    CLIENT_CLOSED,
    EventStream,
    service_of,
    stream_headers,
)
from sidecar.server.service import Caller
from sidecar.server.validation import ServiceError

log = logging.getLogger("sidecar.openai")


def anthropic_caller(request: Request) -> Caller:
    """Dependency: count the call, then authenticate with ``Authorization`` or ``x-api-key``."""
    request.app.state.settings.count_request("messages")
    peer = request.client.host if request.client else ""
    auth = request.headers.get("authorization")
    key = request.headers.get("x-api-key")
    if not auth and key:
        auth = f"Bearer {key}"
    return service_of(request).authenticate(auth, peer)


async def _events(builder: MessageBuilder, buffered: list, events: AsyncIterator) -> AsyncIterator[str]:
    try:
        for ev in builder.start(buffered[0][1]):
            yield sse_event(ev)
        for _, item in buffered:
            for ev in builder.feed(item):
                yield sse_event(ev)
        async for _, item in events:
            for ev in builder.feed(item):
                yield sse_event(ev)
    except ServiceError as exc:  # after the first event: the status line is already sent
        status, body = service_error_body(exc)
        yield sse_event(anthropic_error_body(status, body["error"]["message"]))
    except Exception:
        log.exception("message stream %s failed", builder.rid)
        yield sse_event(anthropic_error_body(500, "internal server error"))


async def _respond(request: Request, runner: ChoiceRunner, builder: MessageBuilder, stream: bool) -> Response:
    events = runner.events()
    handed_over = False
    try:
        if stream:
            buffered = await guard_disconnect(request, runner, first_events(runner, 1, events))
            if buffered is None:
                return Response(status_code=CLIENT_CLOSED)
            if not buffered:
                raise ServiceError("internal", "engine produced no output")
            cache = fmt.cache_header([buffered[0][1].cache.status])
            handed_over = True  # from here the response owns the runner
            body = _events(builder, buffered, events)
            return EventStream(body, runner.cancel, stream_headers(builder.rid, cache))

        async def drain() -> bool:
            async for _, ev in events:
                builder.feed(ev)
            return True

        if await guard_disconnect(request, runner, drain()) is None:
            return Response(status_code=CLIENT_CLOSED)
        cache = fmt.cache_header([builder.last.cache.status] if builder.last else [])
        return JSONResponse(builder.message(), headers={CACHE_HEADER: cache, "x-request-id": builder.rid})
    finally:
        if not handed_over:
            runner.cancel()


async def create_message(
    body: MessagesRequest,
    request: Request,
    service: Annotated[Any, Depends(service_of)],
    who: Caller = Depends(anthropic_caller),
):
    rid = new_id("msg")
    # Translating compiles any tool grammar: a worker thread's job, never the event loop's.
    req = await asyncio.to_thread(generation_request, body, rid)
    builder = MessageBuilder(rid, body.model, list(body.stop_sequences or []), service.token_strings)
    runner = ChoiceRunner(service, who, [req]).start()
    return await _respond(request, runner, builder, bool(body.stream))


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/messages", create_message, methods=["POST"], tags=["anthropic"])
