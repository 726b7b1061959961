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

import asyncio

import base64
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable, Optional, Protocol, Union

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sidecar import __version__
from sidecar.config import ServerConfig
from sidecar.server.metrics import Metrics
from sidecar.server import ui
from sidecar.server.openai import anthropic_api
from sidecar.server.openai import errors as openai_errors
from sidecar.server.openai import format as fmt
from sidecar.server.openai import responses_api
from sidecar.server.openai.limits import BodyLimit
from sidecar.server.openai.models import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from sidecar.server.openai.runner import ChoiceRunner, first_events, guard_disconnect
from sidecar.server.openai.translate import beam_requests, chat_requests, completion_requests
from sidecar.server.openai.transport import (
    CACHE_HEADER,
    CLIENT_CLOSED,
    caller_dependency as _caller,
    EventStream as _EventStream,
    service_of,
    stream_headers as _stream_headers,
)
from sidecar.server.responses_store import ResponseStore
from sidecar.server.reasoning import REASONING_HEADER
from sidecar.server.service import Caller, Event, GenerationRequest
from sidecar.server.validation import ServiceError

log = logging.getLogger("sidecar.openai")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class OpenAIService(Protocol):
    """What the HTTP transport needs of ``InferenceService`` (tests pass a fake)."""

    model_name: str
    serving: bool
    draining: bool

    def authenticate(self, authorization: Optional[str], peer: str = "") -> Caller: ...

    def generate(self, caller: Caller, req: GenerationRequest) -> AsyncIterator[Event]: ...

    async def embed(
        self, caller: Caller, inputs: list[str], model: Optional[str] = None
    ) -> tuple[list[list[float]], int]: ...

    def token_strings(self, ids: list[int]) -> list[str]: ...

    def model_info(self, caller: Optional[Caller] = None) -> dict: ...

    def render_metrics(self) -> tuple[bytes, str]: ...

    def require_operator(self, caller: Caller, action: str) -> None: ...

    async def load_lora(self, caller: Caller, name: str, path: str, tenant: Optional[str] = None) -> None: ...

    async def unload_lora(self, caller: Caller, name: str) -> None: ...


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP server's own limits, and the Prometheus counters it shares with gRPC (None: uncounted)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = 30.0
    metrics: Optional[Metrics] = None
    docs: bool = True  # serve /docs and /openapi.json
    ui: bool = True  # serve the built-in page at GET /
    responses_max_entries: int = 1000  # stored responses per tenant (ResponseStore bounds)
    responses_max_bytes: int = 64 * 1024 * 1024
    responses_ttl_s: float = 3600.0

    @classmethod
    def from_config(cls, server: ServerConfig, metrics: Optional[Metrics]) -> "HttpSettings":
        """Bodies are limited like gRPC messages (``max_message_bytes``)."""
        return cls(
            server.max_message_bytes,
            server.http_read_timeout_s,
            metrics,
            server.serves_docs,
            ui=server.ui,
            responses_max_entries=server.responses_max_entries,
            responses_max_bytes=server.responses_max_bytes,
            responses_ttl_s=server.responses_ttl_s,
        )

    def count_request(self, method: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(api="openai", method=method).inc()

    def count_error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code=code).inc()


class _Call:
    """One chat or completion call: its choices, their state, and how to render them."""

    def __init__(
        self,
        service: OpenAIService,
        body: Union[ChatCompletionRequest, CompletionRequest],
        kind: str,
        rid: str,
        model: str,
        n: int,
        requests: list[GenerationRequest],
    ) -> None:
        self.service, self.body, self.kind, self.rid, self.model, self.n = service, body, kind, rid, model, n
        self.requests = requests
        # Beam search: one request per prompt whose n best hypotheses are its n choices (expand below).
        self.beams = n if getattr(body, "use_beam_search", None) else 1
        self.created = fmt.now()
        self.states = [fmt.ChoiceState() for _ in range(len(requests) * self.beams)]
        self.want_logprobs = bool(body.logprobs) if kind == "chat" else body.logprobs is not None
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.headers: dict[str, str] = {}  # extra response headers

    def token_text(self, ids: list[int]) -> list[str]:
        return self.service.token_strings(ids)

    def chunks(self, k: int, ev: Event) -> list[dict]:
        """Chunks for one event of choice ``k``; updates that choice's state."""
        st = self.states[k]
        out = []
        args = (self.rid, self.model, self.created, k)
        lps = ev.new_logprobs or []
        if self.kind == "chat":
            if not st.started:
                out.append(
                    fmt.chat_chunk(*args, {"role": "assistant", "content": ""}, with_usage=self.include_usage)
                )
            if getattr(ev, "reasoning_delta", ""):
                out.append(
                    fmt.chat_chunk(
                        *args, {"reasoning_content": ev.reasoning_delta}, with_usage=self.include_usage
                    )
                )
            if ev.delta_text or (self.want_logprobs and lps):
                lp = fmt.chat_logprobs(lps, self.token_text) if self.want_logprobs else None
                out.append(
                    fmt.chat_chunk(
                        *args, {"content": ev.delta_text}, logprobs=lp, with_usage=self.include_usage
                    )
                )
            if ev.tool_calls:  # each call whole, in OpenAI's delta shape
                out.append(
                    fmt.chat_chunk(
                        *args,
                        {"tool_calls": [fmt.tool_call(c, True) for c in ev.tool_calls]},
                        with_usage=self.include_usage,
                    )
                )
            if ev.finished:
                out.append(
                    fmt.chat_chunk(*args, {}, finish_reason=ev.finish_reason, with_usage=self.include_usage)
                )
        else:
            if ev.delta_text or (self.want_logprobs and lps):
                lp = (
                    fmt.completion_logprobs(lps, self.token_text, len(st.text))
                    if self.want_logprobs
                    else None
                )
                out.append(
                    fmt.completion_chunk(*args, ev.delta_text, logprobs=lp, with_usage=self.include_usage)
                )
            if ev.finished:
                out.append(
                    fmt.completion_chunk(
                        *args, "", finish_reason=ev.finish_reason, with_usage=self.include_usage
                    )
                )
        st.started = True
        st.update(ev)
        return out

    async def expand(self, events: AsyncIterator) -> AsyncIterator:
        """Events per choice: a beam request's finished event becomes one event per returned hypothesis."""
        async for k, ev in events:
            if self.beams == 1:
                yield k, ev
                continue
            seqs = ev.beams or []
            for i in range(self.beams):
                b = seqs[i] if i < len(seqs) else None
                one = (
                    ev
                    if b is None
                    else dataclasses.replace(
                        ev,
                        text=b.text,
                        delta_text=b.text,
                        token_ids=list(b.token_ids),
                        new_token_ids=list(b.token_ids),
                        completion_tokens=len(b.token_ids),
                        finish_reason=b.finish_reason if ev.finish_reason != "abort" else ev.finish_reason,
                    )
                )
                yield k * self.beams + i, one

    def response(self) -> dict:
        build = fmt.chat_response if self.kind == "chat" else fmt.completion_response
        return build(
            self.rid, self.model, self.created, self.states, self.n, self.want_logprobs, self.token_text
        )

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
                yield fmt.sse(
                    fmt.usage_chunk(
                        self.rid, self.model, self.created, obj, fmt.total_usage(self.states, self.n)
                    )
                )
        except ServiceError as exc:  # after the first event: the status line is already sent
            yield fmt.sse(openai_errors.service_error_body(exc)[1])
        except Exception:
            log.exception("stream %s failed", self.rid)
            yield fmt.sse(
                openai_errors.error_body("internal server error", "server_error", None, "internal_error")
            )
        yield fmt.SSE_DONE


async def _run(request: Request, call: _Call, caller: Caller) -> Response:
    runner = ChoiceRunner(call.service, caller, call.requests).start()
    events = call.expand(runner.events())
    handed_over = False
    try:
        if call.body.stream:
            buffered = await guard_disconnect(request, runner, first_events(runner, len(call.states), events))
            if buffered is None:
                return Response(status_code=CLIENT_CLOSED)
            firsts: dict[int, Event] = {}
            for k, ev in buffered:
                firsts.setdefault(k, ev)
            cache = fmt.cache_header([ev.cache.status for ev in firsts.values()])
            handed_over = True  # from here the response owns the runner
            headers = {
                **_stream_headers(call.rid, cache),
                **fmt.coalesced_header([ev.cache.coalesced for ev in firsts.values()]),
                **call.headers,
            }
            return _EventStream(call.stream(buffered, events), runner.cancel, headers)

        async def drain() -> bool:
            async for k, ev in events:
                call.states[k].update(ev)
            return True

        if await guard_disconnect(request, runner, drain()) is None:
            return Response(status_code=CLIENT_CLOSED)
        cache = fmt.cache_header([s.cache_status for s in call.states])
        return JSONResponse(
            call.response(),
            headers={
                CACHE_HEADER: cache,
                "x-request-id": call.rid,
                **fmt.coalesced_header([s.coalesced for s in call.states]),
                **call.headers,
            },
        )
    finally:
        if not handed_over:
            runner.cancel()


# -- routes: collaborators come from the app's state through typed dependencies ----------------------


Service = Annotated[OpenAIService, Depends(service_of)]


def _operator(action: str) -> Callable[[Request], Caller]:
    """Dependency: as ``_caller``, then refuse (403 naming ``action``) a caller that may not run operator
    actions, before its body is read."""
    authenticate = _caller(action)

    def dependency(request: Request) -> Caller:
        who = authenticate(request)
        service_of(request).require_operator(who, action)
        return who

    return dependency


async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    service: Service,
    who: Caller = Depends(_caller("chat.completions")),
):
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    # Translating compiles any schema or grammar: a worker thread's job, never the event loop's.
    reqs = await asyncio.to_thread(chat_requests, body, rid, service.model_info().get("max_model_len"))
    if body.use_beam_search:
        reqs = beam_requests(reqs, body.n or 1)
    call = _Call(service, body, "chat", rid, body.model or service.model_name, body.n or 1, reqs)
    if body.reasoning_effort is not None and not service.model_info().get("reasoning"):
        call.headers[REASONING_HEADER] = "unsupported"  # accepted; the model does not think
    return await _run(request, call, who)


async def completions(
    body: CompletionRequest, request: Request, service: Service, who: Caller = Depends(_caller("completions"))
):
    rid = f"cmpl-{uuid.uuid4().hex}"
    reqs = await asyncio.to_thread(completion_requests, body, rid)
    if body.use_beam_search:
        reqs = beam_requests(reqs, body.n or 1)
    call = _Call(service, body, "completion", rid, body.model or service.model_name, body.n or 1, reqs)
    return await _run(request, call, who)


def _models(service: OpenAIService, created: int, who: Caller) -> list[dict]:
    """The served model, the LoRA adapters ``who`` may name (``parent``: the base model; ``root``: the
    adapter's path, as vLLM lists them) and, when it has another name, the embedding model."""
    if not service.serving:
        raise ServiceError("unavailable", "the model is not ready (loading or draining)")
    info = service.model_info(who)
    out = [
        {
            "id": service.model_name,
            "object": "model",
            "created": created,
            "owned_by": "llm-sidecar",
            "max_model_len": info.get("max_model_len"),
            # What the model is and what it runs with.
            "architecture": info.get("architecture"),
            # parameters held, and those one token runs through (fewer in a mixture of experts)
            "total_parameters": info.get("total_parameters"),
            "active_parameters": info.get("active_parameters"),
            "dtype": info.get("dtype"),
            "quantization": info.get("quantization"),
            "lm_head": info.get("lm_head"),  # the output head's precision: int8, int4, q8_0, or the dtype
            "device": info.get("device"),
            "reasoning": bool(info.get("reasoning")),
            "tool_call_format": info.get("tool_call_format"),
            "fast_paths": info.get("fast_paths") or [],
            "fast_path_fallbacks": info.get("fast_path_fallbacks") or {},
            "kv_cache_dtype": info.get("kv_cache_dtype"),
            "kv_cache_tokens": info.get("kv_cache_tokens"),
            # each cache group's layers and bytes: paged KV, a hybrid model's linear-attention state slots
            "cache_groups": info.get("cache_groups") or [],
        }
    ]
    for name, path in sorted((info.get("lora_adapters") or {}).items()):
        out.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llm-sidecar",
                "root": path,
                "parent": service.model_name,
                "max_model_len": info.get("max_model_len"),
            }
        )
    emb = info.get("embedding_model")
    if emb and emb != service.model_name:
        out.append({"id": emb, "object": "model", "created": created, "owned_by": "llm-sidecar"})
    return out


async def list_models(request: Request, service: Service, who: Caller = Depends(_caller("models"))):
    return {"object": "list", "data": _models(service, request.app.state.created, who)}


async def get_model(
    model_id: str, request: Request, service: Service, who: Caller = Depends(_caller("models"))
):
    for m in _models(service, request.app.state.created, who):
        if m["id"] == model_id:
            return m
    raise ServiceError("not_found", f"model: unknown model {model_id!r}", field="model")


async def load_lora_adapter(
    body: LoadLoraAdapterRequest, service: Service, who: Caller = Depends(_operator("load_lora_adapter"))
):
    await service.load_lora(who, body.lora_name, body.lora_path, body.tenant)
    return {
        "object": "lora_adapter",
        "id": body.lora_name,
        "status": "loaded",
        "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
    }


async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, service: Service, who: Caller = Depends(_operator("unload_lora_adapter"))
):
    await service.unload_lora(who, body.lora_name)
    return {
        "object": "lora_adapter",
        "id": body.lora_name,
        "status": "unloaded",
        "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
    }


async def embeddings(body: EmbeddingRequest, service: Service, who: Caller = Depends(_caller("embeddings"))):
    try:
        vectors, tokens = await service.embed(who, body.texts(), model=body.model or None)
    except ServiceError as exc:
        if exc.code == "invalid_argument" and exc.message.startswith("inputs"):
            # The service's field is "inputs"; OpenAI's is "input".
            raise ServiceError(exc.code, "input" + exc.message[len("inputs") :], field="input") from None
        raise
    data = []
    for i, v in enumerate(vectors):
        vec: Any = v
        if body.encoding_format == "base64":
            vec = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vec})
    return {
        "object": "list",
        "data": data,
        "model": service.model_info().get("embedding_model") or body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def health(service: Service):
    if service.serving:
        return {"status": "serving"}
    return JSONResponse({"status": "draining" if service.draining else "loading"}, status_code=503)


async def metrics(service: Service):
    data, content_type = service.render_metrics()
    return Response(data, media_type=content_type)


_ROUTES = (  # path, endpoint, method, tag
    ("/v1/chat/completions", chat_completions, "POST", "openai"),
    ("/v1/completions", completions, "POST", "openai"),
    ("/v1/models", list_models, "GET", "openai"),
    ("/v1/models/{model_id:path}", get_model, "GET", "openai"),
    ("/v1/embeddings", embeddings, "POST", "openai"),
    ("/v1/load_lora_adapter", load_lora_adapter, "POST", "openai"),
    ("/v1/unload_lora_adapter", unload_lora_adapter, "POST", "openai"),
    ("/health", health, "GET", "ops"),
    ("/metrics", metrics, "GET", "ops"),
)


def create_app(
    service: OpenAIService, max_body_bytes: Optional[int] = None, settings: Optional[HttpSettings] = None
) -> FastAPI:
    """The OpenAI-compatible app over ``service`` (an ``InferenceService``).

    ``settings`` default to ``HttpSettings()`` (no metrics); ``max_body_bytes``, when given, overrides
    their body limit.
    """
    settings = settings or HttpSettings()
    if max_body_bytes is not None:
        settings = dataclasses.replace(settings, max_body_bytes=max_body_bytes)
    app = FastAPI(
        title="llm-sidecar OpenAI-compatible API",
        version=__version__,
        redoc_url=None,
        docs_url="/docs" if settings.docs else None,
        openapi_url="/openapi.json" if settings.docs else None,
    )
    app.state.service = service
    app.state.settings = settings
    app.state.created = fmt.now()  # "created" of the listed models: when this server started
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.read_timeout_s)
    openai_errors.install(app, settings.count_error)
    openai_errors.document_errors(app)
    for path, endpoint, method, tag in _ROUTES:
        app.add_api_route(path, endpoint, methods=[method], tags=[tag])
    store = ResponseStore(
        settings.responses_max_entries, settings.responses_max_bytes, settings.responses_ttl_s
    )
    responses_api.add_routes(app, store)
    anthropic_api.add_routes(app)
    if settings.ui:
        ui.add_routes(app)
    return app
