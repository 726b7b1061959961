"""Routes of the Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``.

One response is one engine request run by a ``ChoiceRunner`` like a chat completion, so it is
aborted and its KV blocks freed however the call ends. A stored response (``store``, default true
as on OpenAI) goes to the app's ``ResponseStore`` under the caller's tenant once it completed; a
follow-up's ``previous_response_id`` is looked up there under the same tenant only, and its
conversation is replayed ahead of the new input, so the prompt starts with the same tokens and the
prefix cache serves them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, AsyncIterator, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sidecar.server.openai import format as fmt
from sidecar.server.openai.transport import (
    CACHE_HEADER,
    CLIENT_CLOSED,
    EventStream,
    caller_dependency,
    service_of,
    stream_headers,
)
from sidecar.server.openai.errors import service_error_body
from sidecar.server.openai.responses import (
    ResponseBuilder,
    generation_request,
    input_messages,
    new_id,
    request_echo,
    sse_event,
)
from sidecar.server.openai.responses_models import ResponsesRequest
from sidecar.server.openai.runner import ChoiceRunner, first_events, guard_disconnect
from sidecar.server.responses_store import ResponseStore
from sidecar.server.service import Caller
from sidecar.server.validation import ServiceError, invalid

log = logging.getLogger("sidecar.openai")


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _history(store: ResponseStore, who: Caller, previous: Optional[str]) -> list[dict]:
    if previous is None:
        return []
    entry = store.get(who.tenant, previous)
    if entry is None:
        raise invalid("previous_response_id", f"no stored response with id {previous!r}")
    return list(entry.messages)


async def _events(
    builder: ResponseBuilder, buffered: list, events: AsyncIterator, on_done: Callable[[], None]
) -> AsyncIterator[str]:
    try:
        for ev in builder.start():
            yield sse_event(ev)
        for _, item in buffered:
            for ev in builder.feed(item):
                yield sse_event(ev)
        async for _, item in events:
            for ev in builder.feed(item):
                yield sse_event(ev)
        on_done()
    except ServiceError as exc:  # after the first event: the status line is already sent
        err = service_error_body(exc)[1]["error"]
        yield sse_event(builder.failed({"code": err["code"], "message": err["message"]})[0])
    except Exception:
        log.exception("response stream %s failed", builder.echo["id"])
        yield sse_event(builder.failed({"code": "server_error", "message": "internal server error"})[0])


async def _respond(
    request: Request,
    runner: ChoiceRunner,
    builder: ResponseBuilder,
    stream: bool,
    on_done: Callable[[], None],
) -> Response:
    rid = builder.echo["id"]
    events = runner.events()
    handed_over = False
    try:
        if stream:
            buffered = await guard_disconnect(request, runner, first_events(runner, 1, events))
            if buffered is None:
                return Response(status_code=CLIENT_CLOSED)
            cache = fmt.cache_header([ev.cache.status for _, ev in buffered[:1]])
            handed_over = True  # from here the response owns the runner
            body = _events(builder, buffered, events, on_done)
            return EventStream(body, runner.cancel, stream_headers(rid, cache))

        async def drain() -> bool:
            async for _, ev in events:
                builder.feed(ev)
            return True

        if await guard_disconnect(request, runner, drain()) is None:
            return Response(status_code=CLIENT_CLOSED)
        on_done()
        cache = fmt.cache_header([builder.last.cache.status] if builder.last else [])
        return JSONResponse(builder.snapshot(), headers={CACHE_HEADER: cache, "x-request-id": rid})
    finally:
        if not handed_over:
            runner.cancel()


async def create_response(
    body: ResponsesRequest,
    request: Request,
    service: Annotated[Any, Depends(service_of)],
    who: Caller = Depends(caller_dependency("responses")),
):
    store = _store(request)
    history = _history(store, who, body.previous_response_id)
    rid = new_id("resp")
    turn = input_messages(body.input, history)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    max_len = service.model_info().get("max_model_len")
    # Translating compiles any schema or grammar: a worker thread's job, never the event loop's.
    req = await asyncio.to_thread(generation_request, body, rid, system + history + turn, max_len)
    builder = ResponseBuilder(request_echo(body, rid, body.model or service.model_name, fmt.now()))

    def on_done() -> None:
        if body.store is not False and builder.status in ("completed", "incomplete"):
            store.put(who.tenant, rid, builder.snapshot(), history + turn + builder.messages())

    runner = ChoiceRunner(service, who, [req]).start()
    return await _respond(request, runner, builder, bool(body.stream), on_done)


def _not_found(response_id: str) -> StarletteHTTPException:
    return StarletteHTTPException(404, f"response_id: no stored response with id {response_id!r}")


async def get_response(
    response_id: str, request: Request, who: Caller = Depends(caller_dependency("responses.get"))
):
    entry = _store(request).get(who.tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


async def delete_response(
    response_id: str, request: Request, who: Caller = Depends(caller_dependency("responses.delete"))
):
    if not _store(request).delete(who.tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def add_routes(app: FastAPI, store: ResponseStore) -> None:
    app.state.responses = store
    app.add_api_route("/v1/responses", create_response, methods=["POST"], tags=["openai"])
    app.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"], tags=["openai"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"], tags=["openai"])
