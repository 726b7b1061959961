"""OpenAI-compatible HTTP API over the shared ``InferenceService``.

``create_app(service)`` returns the FastAPI app that ``sidecar.server.app``
serves with uvicorn next to the gRPC server, on the same event loop and engine.
This module only translates: auth, rate limits, validation against the model,
the semantic cache and the engine all live in the service.

Streaming responses are Server-Sent Events ending with ``data: [DONE]``. The
first event of every choice is awaited before the response starts, so refusals
(rate limit, unknown model, bad prompt) still get their status code and the
``x-sidecar-cache`` header can be set. Whatever way a call ends, its engine
requests are aborted and their KV blocks freed (see ``runner``).
"""
from __future__ import annotations

import base64
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sidecar import __version__
from sidecar.server.openai import errors as openai_errors
from sidecar.server.openai import format as fmt
from sidecar.server.openai.limits import BodyLimit
from sidecar.server.openai.models import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from sidecar.server.openai.runner import ChoiceRunner, first_events, guard_disconnect
from sidecar.server.openai.translate import chat_requests, completion_requests
from sidecar.server.validation import ServiceError

log = logging.getLogger("sidecar.openai")

CACHE_HEADER = "x-sidecar-cache"
# What a handler returns when the client left before the answer was ready: nobody reads it.
CLIENT_CLOSED = 499
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class _EventStream(StreamingResponse):
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


def _stream_headers(rid: str, cache: str) -> dict:
    return {CACHE_HEADER: cache, "x-request-id": rid, "cache-control": "no-cache", "x-accel-buffering": "no"}


class _Call:
    """One chat or completion call: its choices, their state, and how to render them."""

    def __init__(self, service: Any, body: Any, kind: str, rid: str, model: str, n: int, requests: list) -> None:
        self.service, self.body, self.kind, self.rid, self.model, self.n = service, body, kind, rid, model, n
        self.requests = requests
        self.created = fmt.now()
        self.states = [fmt.ChoiceState() for _ in requests]
        self.want_logprobs = bool(body.logprobs) if kind == "chat" else body.logprobs is not None
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)

    def token_text(self, ids: list[int]) -> list[str]:
        return self.service.token_strings(ids)

    def chunks(self, k: int, ev: Any) -> list[dict]:
        """Chunks for one event of choice ``k``; updates that choice's state."""
        st = self.states[k]
        out = []
        args = (self.rid, self.model, self.created, k)
        lps = ev.new_logprobs or []
        if self.kind == "chat":
            if not st.started:
                out.append(fmt.chat_chunk(*args, {"role": "assistant", "content": ""}, with_usage=self.include_usage))
            if ev.delta_text or (self.want_logprobs and lps):
                lp = fmt.chat_logprobs(lps, self.token_text) if self.want_logprobs else None
                out.append(fmt.chat_chunk(*args, {"content": ev.delta_text}, logprobs=lp,
                                          with_usage=self.include_usage))
            if ev.tool_calls:  # each call whole, in OpenAI's delta shape
                out.append(fmt.chat_chunk(*args, {"tool_calls": [fmt.tool_call(c, True) for c in ev.tool_calls]},
                                          with_usage=self.include_usage))
            if ev.finished:
                out.append(fmt.chat_chunk(*args, {}, finish_reason=ev.finish_reason, with_usage=self.include_usage))
        else:
            if ev.delta_text or (self.want_logprobs and lps):
                lp = fmt.completion_logprobs(lps, self.token_text, len(st.text)) if self.want_logprobs else None
                out.append(fmt.completion_chunk(*args, ev.delta_text, logprobs=lp, with_usage=self.include_usage))
            if ev.finished:
                out.append(fmt.completion_chunk(*args, "", finish_reason=ev.finish_reason,
                                                with_usage=self.include_usage))
        st.started = True
        st.update(ev)
        return out

    def response(self) -> dict:
        build = fmt.chat_response if self.kind == "chat" else fmt.completion_response
        return build(self.rid, self.model, self.created, self.states, self.n, self.want_logprobs, self.token_text)

    async def stream(self, buffered: list, events: AsyncIterator) -> AsyncIterator[str]:
        try:
            for k, ev in buffered:
                for chunk in self.chunks(k, ev):
                    yield fmt.sse(chunk)
            async for k, ev in events:
                for chunk in self.chunks(k, ev):
                    yield fmt.sse(chunk)
            if self.include_usage:
                obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
                yield fmt.sse(fmt.usage_chunk(self.rid, self.model, self.created, obj,
                                              fmt.total_usage(self.states, self.n)))
        except ServiceError as exc:  # after the first event: the status line is already sent
            yield fmt.sse(openai_errors.service_error_body(exc)[1])
        except Exception:
            log.exception("stream %s failed", self.rid)
            yield fmt.sse(openai_errors.error_body("internal server error", "server_error", None, "internal_error"))
        yield fmt.SSE_DONE


async def _run(request: Request, call: _Call, caller: Any) -> Response:
    runner = ChoiceRunner(call.service, caller, call.requests).start()
    events = runner.events()
    handed_over = False
    try:
        if call.body.stream:
            buffered = await guard_disconnect(request, runner, first_events(runner, len(call.requests), events))
            if buffered is None:
                return Response(status_code=CLIENT_CLOSED)
            firsts: dict[int, Any] = {}
            for k, ev in buffered:
                firsts.setdefault(k, ev)
            cache = fmt.cache_header([ev.cache.status for ev in firsts.values()])
            handed_over = True  # from here the response owns the runner
            return _EventStream(call.stream(buffered, events), runner.cancel, _stream_headers(call.rid, cache))

        async def drain() -> bool:
            async for k, ev in events:
                call.states[k].update(ev)
            return True

        if await guard_disconnect(request, runner, drain()) is None:
            return Response(status_code=CLIENT_CLOSED)
        cache = fmt.cache_header([s.cache_status for s in call.states])
        return JSONResponse(call.response(), headers={CACHE_HEADER: cache, "x-request-id": call.rid})
    finally:
        if not handed_over:
            runner.cancel()


def create_app(service: Any, max_body_bytes: Optional[int] = None) -> FastAPI:
    """The OpenAI-compatible app over ``service`` (an ``InferenceService``).

    Request bodies are limited to ``max_body_bytes`` (default: the server's
    ``max_message_bytes``, the same limit gRPC messages have).
    """
    app = FastAPI(title="llm-sidecar OpenAI-compatible API", version=__version__,
                  docs_url="/docs", redoc_url=None)
    app.state.service = service
    app_created = fmt.now()  # "created" of the listed models: when this server started
    if max_body_bytes is None:
        server_cfg = getattr(getattr(service, "cfg", None), "server", None)
        max_body_bytes = getattr(server_cfg, "max_message_bytes", DEFAULT_MAX_BODY_BYTES)
    read_timeout = getattr(getattr(getattr(service, "cfg", None), "server", None), "http_read_timeout_s", 30.0)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, read_timeout_s=read_timeout)
    counters = getattr(service, "metrics", None)  # the service's Prometheus counters, shared with gRPC

    def count_request(method: str) -> None:
        if counters is not None:
            counters.requests.labels(api="openai", method=method).inc()

    def count_error(code: str) -> None:
        if counters is not None:
            counters.errors.labels(code=code).inc()

    openai_errors.install(app, count_error)
    openai_errors.document_errors(app)

    def caller(method: str) -> Callable[[Request], Any]:
        """Dependency: count the call, then authenticate. Dependencies run before body
        validation, so refused requests are counted too (as the gRPC adapter counts them)."""
        def dependency(request: Request) -> Any:
            count_request(method)
            peer = request.client.host if request.client else ""
            return service.authenticate(request.headers.get("authorization"), peer)
        return dependency

    def max_model_len() -> Optional[int]:
        return service.model_info().get("max_model_len")

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               who: Any = Depends(caller("chat.completions"))):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = chat_requests(body, rid, max_model_len())
        return await _run(request, _Call(service, body, "chat", rid, body.model or service.model_name,
                                         body.n or 1, reqs), who)

    @app.post("/v1/completions", tags=["openai"])
    async def completions(body: CompletionRequest, request: Request,
                          who: Any = Depends(caller("completions"))):
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = completion_requests(body, rid)
        return await _run(request, _Call(service, body, "completion", rid, body.model or service.model_name,
                                         body.n or 1, reqs), who)

    def _models() -> list[dict]:
        if not service.serving:
            raise ServiceError("unavailable", "the model is not ready (loading or draining)")
        info = service.model_info()
        created = int(getattr(service, "started_at", 0) or app_created)
        out = [{"id": service.model_name, "object": "model", "created": created, "owned_by": "llm-sidecar",
                "max_model_len": info.get("max_model_len"), "fast_paths": info.get("fast_paths") or [],
                "fast_path_fallbacks": info.get("fast_path_fallbacks") or {},
                "kv_cache_dtype": info.get("kv_cache_dtype"), "kv_cache_tokens": info.get("kv_cache_tokens")}]
        emb = info.get("embedding_model")
        if emb and emb != service.model_name:
            out.append({"id": emb, "object": "model", "created": created, "owned_by": "llm-sidecar"})
        return out

    @app.get("/v1/models", tags=["openai"])
    async def list_models(who: Any = Depends(caller("models"))):
        return {"object": "list", "data": _models()}

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def get_model(model_id: str, who: Any = Depends(caller("models"))):
        for m in _models():
            if m["id"] == model_id:
                return m
        raise ServiceError("not_found", f"model: unknown model {model_id!r}", field="model")

    @app.post("/v1/embeddings", tags=["openai"])
    async def embeddings(body: EmbeddingRequest, who: Any = Depends(caller("embeddings"))):
        emb_name = service.model_info().get("embedding_model") if service.serving else None
        if body.model and body.model not in (emb_name, service.model_name):
            raise ServiceError("not_found", f"model: unknown model {body.model!r}; embeddings come from "
                               f"{emb_name!r}", field="model")
        try:
            vectors, tokens = await service.embed(who, body.texts())
        except ServiceError as exc:
            if exc.code == "invalid_argument" and exc.message.startswith("inputs"):
                # The service's field is "inputs"; OpenAI's is "input".
                raise ServiceError(exc.code, "input" + exc.message[len("inputs"):], field="input") from None
            raise
        data = []
        for i, v in enumerate(vectors):
            vec: Any = v
            if body.encoding_format == "base64":
                vec = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return {"object": "list", "data": data, "model": emb_name or body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.get("/health", tags=["ops"])
    async def health():
        if service.serving:
            return {"status": "serving"}
        state = "draining" if getattr(service, "draining", False) else "loading"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics", tags=["ops"])
    async def metrics():
        data, content_type = service.render_metrics()
        return Response(data, media_type=content_type)

    return app
