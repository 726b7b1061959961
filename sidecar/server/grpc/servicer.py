"""gRPC adapter: sidecar.v1.Inference over InferenceService, plus health and reflection.

Streaming handlers write with ``context.write`` from a plain coroutine, so a
client cancel or disconnect cancels exactly this coroutine: the ``finally``
closes the service stream, which aborts the engine request.
"""

from __future__ import annotations

import asyncio

import dataclasses
import logging
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from sidecar.engine.request import SamplingParams
from sidecar.server.admin import LOAD_LORA, UNLOAD_LORA
from sidecar.server.grpc import convert
from sidecar.server.reasoning import REASONING_EFFORTS, REASONING_HEADER
from sidecar.server.service import Event, GenerationRequest, InferenceService, ServiceError
from sidecar.server.validation import check_request_id, sampling_params
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

log = logging.getLogger("sidecar.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "sidecar.v1.Inference"

STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "rate_limited": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "cache_miss": grpc.StatusCode.NOT_FOUND,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "internal": grpc.StatusCode.INTERNAL,
}
CACHE_CONTROL = {
    pb.CACHE_CONTROL_DEFAULT: "default",
    pb.CACHE_CONTROL_SKIP: "skip",
    pb.CACHE_CONTROL_REFRESH: "refresh",
    pb.CACHE_CONTROL_ONLY: "only",
}
FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
CACHE_STATUS = {
    "miss": pb.CACHE_STATUS_MISS,
    "hit_exact": pb.CACHE_STATUS_HIT_EXACT,
    "hit_semantic": pb.CACHE_STATUS_HIT_SEMANTIC,
    "bypass": pb.CACHE_STATUS_BYPASS,
}
_OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "speculative",
    "beam_width",
    "length_penalty",
    "kv_budget",
    "kv_eviction",
)


def _params(s: pb.SamplingParams) -> SamplingParams:
    kw: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
    ):
        if name in kw:  # proto floats are float32; round so 0.9 stays 0.9 in messages and cache keys
            kw[name] = round(float(kw[name]), 6)
    kw.update(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.logprobs:
        kw["logprobs"] = int(s.logprobs)
    if s.logit_bias:
        kw["logit_bias"] = {int(t): round(float(b), 6) for t, b in s.logit_bias.items()}
    return sampling_params(**kw)


def _request(msg: Any, timeout_s: Optional[float], chat: bool) -> GenerationRequest:
    """The GenerationRequest of a GenerateRequest / ChatRequest; fields are checked in wire order
    (sampling, response_format, messages, tools) and the first problem raised, naming its field."""
    check_request_id(msg.request_id)  # first: everything after may log it
    params = _params(msg.sampling)
    structured = convert.response_format(msg)
    if structured is not None:
        if params.beam_width is not None:
            raise ServiceError(
                "invalid_argument", "response_format: cannot be used with beam search (sampling.beam_width)"
            )
        params = dataclasses.replace(params, structured=structured)
    common: dict[str, Any] = dict(
        params=params,
        request_id=msg.request_id or None,
        priority=msg.priority,
        cache_control=CACHE_CONTROL.get(msg.cache_control, f"unknown({msg.cache_control})"),
        cache_salt=msg.cache_salt,
        cache_sampled=msg.cache_sampled,
        timeout_s=timeout_s,
        model=msg.model or None,
        max_tokens_set=msg.sampling.HasField("max_tokens"),
    )
    if chat:
        messages = convert.messages(msg.messages)
        return GenerationRequest(
            messages=messages, **convert.tools(msg), **convert.reasoning_fields(msg), **common
        )
    return GenerationRequest(
        prompt=msg.prompt or None, prompt_token_ids=list(msg.prompt_token_ids) or None, **common
    )


def _peer_host(peer: str) -> str:
    """ "ipv4:127.0.0.1:5555" / "ipv6:[::1]:5555" -> the address without the port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def _cache(ev: Event) -> pb.CacheInfo:
    c = ev.cache
    return pb.CacheInfo(
        status=CACHE_STATUS.get(c.status, pb.CACHE_STATUS_UNSPECIFIED),
        similarity=c.similarity,
        matched_query=c.matched_query,
        bypass_reason=c.bypass_reason,
        coalesced=c.coalesced,
    )


def _usage(ev: Event) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        cached_tokens=ev.cached_tokens,
        total_tokens=ev.prompt_tokens + ev.completion_tokens,
        reasoning_tokens=ev.reasoning_tokens,
    )


def _timing(ev: Event) -> pb.Timing:
    return pb.Timing(queue_ms=ev.queue_ms or 0.0, ttft_ms=ev.ttft_ms or 0.0, total_ms=ev.total_ms or 0.0)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    # -- plumbing --------------------------------------------------------------
    async def _fail(self, context: grpc.aio.ServicerContext, err: ServiceError, request_id: str = "") -> None:
        # A caller's id is logged only once it passed validation; the formatter escapes the rest.
        try:
            check_request_id(request_id)
        except ServiceError:
            request_id = ""
        log.info(
            "request refused",
            extra={"request_id": request_id or None, "code": err.code, "error": err.message},
        )
        trailing = ()
        if err.retry_after_s is not None:
            trailing = (("retry-after-ms", str(max(1, int(err.retry_after_s * 1000 + 0.999)))),)
        self.service.metrics.errors.labels(code=err.code).inc()
        await context.abort(STATUS[err.code], err.message, trailing_metadata=trailing)

    def _caller(self, context: grpc.aio.ServicerContext, method: str) -> Any:
        self.service.metrics.requests.labels(api="grpc", method=method).inc()
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        return self.service.authenticate(md.get("authorization"), _peer_host(context.peer() or ""))

    async def _reasoning_header(self, req: GenerationRequest, context: grpc.aio.ServicerContext) -> None:
        """``x-sidecar-reasoning: unsupported`` in the initial metadata when a request sets reasoning_effort for
        a model that does not think (accepted, and changes nothing)."""
        if (
            req.reasoning_effort in REASONING_EFFORTS
            and self.service.engine is not None
            and not self.service.model_info().get("reasoning")
        ):
            await context.send_initial_metadata(((REASONING_HEADER, "unsupported"),))

    def _logprobs(self, lps: Optional[list]) -> list:
        if not lps:
            return []
        strs = self.service.token_strings
        out = []
        for lp in lps:
            top = [
                pb.TopLogprob(token_id=t, token=s, logprob=v)
                for (t, v), s in zip(lp.top, strs([t for t, _ in lp.top]))
            ]
            out.append(
                pb.TokenLogprob(
                    token_id=lp.token_id, token=strs([lp.token_id])[0], logprob=lp.logprob, top_logprobs=top
                )
            )
        return out

    async def _unary(
        self, msg: Any, context: grpc.aio.ServicerContext, chat: bool, method: str
    ) -> pb.Completion:
        try:
            caller = self._caller(context, method)
            req = await asyncio.to_thread(_request, msg, context.time_remaining(), chat)  # compiles grammars
            await self._reasoning_header(req, context)
            last, lps, calls = None, [], []
            agen = self.service.generate(caller, req)
            try:
                async for ev in agen:
                    last = ev
                    calls.extend(ev.tool_calls)
                    if ev.new_logprobs:
                        lps.extend(ev.new_logprobs)
            finally:
                await agen.aclose()
            return pb.Completion(
                request_id=last.request_id,
                text=last.text,
                token_ids=last.token_ids,
                finish_reason=FINISH.get(last.finish_reason, 0),
                usage=_usage(last),
                timing=_timing(last),
                cache=_cache(last),
                logprobs=self._logprobs(lps),
                model=msg.model or self.service.model_name,
                tool_calls=convert.tool_calls(calls),
                reasoning=last.reasoning_text,
            )
        except ServiceError as err:
            await self._fail(context, err, msg.request_id)

    async def _stream(self, msg: Any, context: grpc.aio.ServicerContext, chat: bool, method: str) -> None:
        try:
            caller = self._caller(context, method)
            req = await asyncio.to_thread(_request, msg, context.time_remaining(), chat)  # compiles grammars
            await self._reasoning_header(req, context)
            agen = self.service.generate(caller, req)
            try:
                first = True
                async for ev in agen:
                    chunk = pb.CompletionChunk(
                        request_id=ev.request_id,
                        delta=ev.delta_text,
                        token_ids=ev.new_token_ids,
                        logprobs=self._logprobs(ev.new_logprobs),
                        tool_calls=convert.tool_calls(ev.tool_calls),
                        reasoning_delta=ev.reasoning_delta,
                    )
                    if first or ev.finished:
                        chunk.cache.CopyFrom(_cache(ev))
                    if ev.finished:
                        chunk.finish_reason = FINISH.get(ev.finish_reason, 0)
                        chunk.usage.CopyFrom(_usage(ev))
                        chunk.timing.CopyFrom(_timing(ev))
                    first = False
                    await context.write(chunk)
            finally:
                # Runs on cancel/disconnect too: closing the stream aborts the engine request.
                await agen.aclose()
        except ServiceError as err:
            await self._fail(context, err, msg.request_id)

    # -- RPCs ------------------------------------------------------------------
    async def Generate(self, request, context):
        return await self._unary(request, context, chat=False, method="Generate")

    async def GenerateStream(self, request, context):
        await self._stream(request, context, chat=False, method="GenerateStream")

    async def Chat(self, request, context):
        return await self._unary(request, context, chat=True, method="Chat")

    async def ChatStream(self, request, context):
        await self._stream(request, context, chat=True, method="ChatStream")

    async def Embed(self, request, context):
        try:
            caller = self._caller(context, "Embed")
            vecs, n = await self.service.embed(caller, list(request.inputs), model=request.model or None)
            return pb.EmbedResponse(
                embeddings=[pb.Embedding(values=v) for v in vecs],
                model=self.service.cache_step.embedding_model_name(),
                dimensions=len(vecs[0]) if vecs else 0,
                prompt_tokens=n,
            )
        except ServiceError as err:
            await self._fail(context, err)

    async def Tokenize(self, request, context):
        try:
            caller = self._caller(context, "Tokenize")
            messages = convert.messages(request.messages) or None
            specs = convert.tool_specs(request.tools) or None
            ids, strings = await self.service.tokenize(
                caller, request.text or None, messages, request.add_special_tokens, specs
            )
            return pb.TokenizeResponse(
                token_ids=ids,
                count=len(ids),
                tokens=strings,
                max_model_len=int(self.service.model_info().get("max_model_len") or 0),
            )
        except ServiceError as err:
            await self._fail(context, err)

    async def GetModelInfo(self, request, context):
        try:
            caller = self._caller(context, "GetModelInfo")
            self.service.check_loaded()
            i = self.service.model_info(caller)
            return pb.ModelInfo(
                model=i["model"],
                architecture=str(i.get("architecture", "")),
                dtype=str(i.get("dtype", "")),
                quantization=str(i.get("quantization") or "none"),
                max_model_len=int(i.get("max_model_len") or 0),
                vocab_size=int(i.get("vocab_size") or 0),
                block_size=int(i.get("block_size") or 0),
                num_kv_blocks=int(i.get("num_kv_blocks") or 0),
                prefix_caching=bool(i.get("prefix_caching")),
                embedding_model=i.get("embedding_model", ""),
                embedding_dimensions=i.get("embedding_dimensions", 0),
                semantic_cache=bool(i.get("semantic_cache")),
                version=i["version"],
                device=str(i.get("device", "")),
                fast_paths=list(i.get("fast_paths") or ()),
                fast_path_fallbacks=dict(i.get("fast_path_fallbacks") or {}),
                kv_cache_dtype=str(i.get("kv_cache_dtype") or ""),
                kv_cache_tokens=int(i.get("kv_cache_tokens") or 0),
                lora_adapters=[
                    pb.LoraAdapter(name=n, path=p, base_model=i["model"])
                    for n, p in sorted((i.get("lora_adapters") or {}).items())
                ],
                reasoning=bool(i.get("reasoning")),
                tool_call_format=str(i.get("tool_call_format") or ""),
                dtype_reason=str(i.get("dtype_reason") or ""),
                total_parameters=int(i.get("total_parameters") or 0),
                active_parameters=int(i.get("active_parameters") or 0),
            )
        except ServiceError as err:
            await self._fail(context, err)

    async def LoadLoraAdapter(self, request, context):
        try:
            caller = self._caller(context, "LoadLoraAdapter")
            self.service.require_operator(caller, LOAD_LORA)
            await self.service.load_lora(caller, request.lora_name, request.lora_path, request.tenant or None)
            return pb.LoraAdapterResponse(lora_name=request.lora_name, status="loaded")
        except ServiceError as err:
            await self._fail(context, err)

    async def UnloadLoraAdapter(self, request, context):
        try:
            caller = self._caller(context, "UnloadLoraAdapter")
            self.service.require_operator(caller, UNLOAD_LORA)
            await self.service.unload_lora(caller, request.lora_name)
            return pb.LoraAdapterResponse(lora_name=request.lora_name, status="unloaded")
        except ServiceError as err:
            await self._fail(context, err)

    async def GetStats(self, request, context):
        try:
            self._caller(context, "GetStats")
            self.service.check_loaded()
            s = self.service.stats()
            fields = {f.name for f in pb.EngineStats.DESCRIPTOR.fields}
            return pb.EngineStats(**{k: v for k, v in s.items() if k in fields and v is not None})
        except ServiceError as err:
            await self._fail(context, err)


class Health:
    """Standard grpc.health.v1 status for "" and sidecar.v1.Inference."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()

    async def set(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)


class _Malformed:
    """Stands in for a request whose bytes are not a valid message of its type."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Any) -> Any:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError and friends: the caller's fault, answered below
            return _Malformed(str(exc))

    return deserialize


def _refusing_malformed(behaviour: Any, method: str, service: InferenceService) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            # Without this grpc answers UNKNOWN and names the parser's exception class.
            service.metrics.requests.labels(api="grpc", method=method).inc()
            service.metrics.errors.labels(code="invalid_argument").inc()
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid {method} request message (malformed protobuf)",
            )
        return await behaviour(request, context)

    return handle


def _method_handlers(servicer: InferenceServicer, service: InferenceService) -> dict:
    """The generated handler table, with requests parsed leniently so bad bytes are INVALID_ARGUMENT."""
    out = {}
    for m in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        req_cls, resp_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        out[m.name] = make(
            _refusing_malformed(getattr(servicer, m.name), m.name, service),
            request_deserializer=_lenient(req_cls.FromString),
            response_serializer=resp_cls.SerializeToString,
        )
    return out


def build_server(
    service: InferenceService,
    health: Health,
    max_message_bytes: int,
    max_concurrent_streams: int,
    max_connection_age_s: float = 0.0,
    max_connection_age_grace_s: float = 0.0,
) -> grpc.aio.Server:
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        # A second server on the same port must fail to bind, not share it.
        ("grpc.so_reuseport", 0),
        # Server pings find clients that vanished without closing; their calls are cancelled,
        # which aborts their engine requests and frees their KV blocks.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Accept client keepalive pings every 10 s, also between calls (grpc-java/netty clients use them).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if max_connection_age_s > 0:
        # GOAWAY on connections older than this (gRPC core adds +-10% jitter): clients
        # reconnect, re-resolve the target and spread over replicas added meanwhile.
        options += [
            ("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", round(max_connection_age_grace_s * 1000)),
        ]
    server = grpc.aio.server(options=options)
    handlers = _method_handlers(InferenceServicer(service), service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    _enable_reflection(server)
    return server


# grpcurl, Postman and current grpc-java ask grpc.reflection.v1 first; older tools only know v1alpha.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class _Reflection(reflection.aio.ReflectionServicer):
    """grpc's reflection servicer, also finding the file of a method (``pkg.Service.Method``), which
    ``grpcurl describe`` asks for and the protobuf pool does not index."""

    def _file_containing_symbol(self, request, fully_qualified_name):
        service_name, _, method = fully_qualified_name.rpartition(".")
        try:
            self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            try:
                if method in self._pool.FindServiceByName(service_name).methods_by_name:
                    fully_qualified_name = service_name
            except KeyError:
                pass  # not a method either: the base class answers NOT_FOUND
        return super()._file_containing_symbol(request, fully_qualified_name)


def _enable_reflection(server: grpc.aio.Server) -> None:
    """Serve reflection under both ``grpc.reflection.v1`` and ``v1alpha``: the two protos declare the
    same messages with the same field numbers, so one servicer answers both on the wire."""
    names = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        REFLECTION_V1,
        reflection.SERVICE_NAME,
    )
    servicer = _Reflection(names)
    for service_name in (REFLECTION_V1, reflection.SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service_name, {"ServerReflectionInfo": handler}),)
        )
