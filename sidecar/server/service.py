"""Protocol-neutral inference service shared by the gRPC and OpenAI HTTP adapters.

Auth, rate limits, validation, the semantic cache, metrics and engine calls live
here once; the adapters only translate wire messages to ``GenerationRequest``
and ``Event``/``ServiceError`` back to wire messages and status codes.

Resource contract: ``generate`` is an async generator; however it ends (last
event, error, the consumer closing it, task cancellation) the engine stream is
closed, which aborts the engine request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from sidecar.config import SidecarConfig
from sidecar.engine.request import QueueFullError, SamplingParams
from sidecar.server import tools
from sidecar.server.cache_step import CacheInfo, CacheStep
from sidecar.server.metrics import Metrics
from sidecar.server.security import AuthError, AuthThrottle, Authenticator, RateLimiter, load_api_keys
from sidecar.server.validation import ServiceError, check_request, check_text, invalid, sampling_params

log = logging.getLogger("sidecar.service")

__all__ = ["ServiceError", "Caller", "GenerationRequest", "CacheInfo", "Event", "InferenceService",
           "sampling_params"]

QUEUE_FULL_RETRY_S = 0.5


@dataclass
class Caller:
    tenant: str = ""
    key_id: Optional[str] = None


@dataclass
class GenerationRequest:
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    messages: Optional[list[dict]] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Optional[str] = None
    priority: int = 0
    cache_control: str = "default"
    cache_salt: str = ""
    cache_sampled: bool = False
    timeout_s: Optional[float] = None
    model: Optional[str] = None
    max_tokens_set: bool = True  # False: params.max_tokens is a default, lowered to fit the context
    # Chat only: tools (sidecar.server.tools.ToolSpec), "none" | "auto" | "required" | "function:<name>".
    tools: Optional[list] = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True


@dataclass
class Event:
    request_id: str
    delta_text: str
    new_token_ids: list[int]
    new_logprobs: Optional[list]
    finished: bool
    finish_reason: Optional[str]
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_ms: Optional[float]
    ttft_ms: Optional[float]
    total_ms: Optional[float]
    cache: CacheInfo
    tool_calls: list = field(default_factory=list)  # calls completed in this event (text holds no markup)


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else s * 1000.0


def _round_ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else round(s * 1000.0, 2)


class InferenceService:
    """Created before the model loads (``serving`` False); ``attach`` makes it serve."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.engine: Any = None  # AsyncEngine once attached
        self.cache_step = CacheStep(None, None, cfg.cache)
        self.serving = False
        self.draining = False
        self.model_name = cfg.server.served_model_name or cfg.engine.model
        self.auth = Authenticator(load_api_keys(cfg.server.api_keys, cfg.server.api_keys_file))
        self.auth_throttle = AuthThrottle(cfg.server.auth_failures_per_min)
        self.limiter = RateLimiter(cfg.server.rate_limit_rps, cfg.server.rate_limit_burst,
                                   cfg.server.rate_limit_tpm)
        # Late-bound: attach() replaces cache_step once the cache has loaded.
        self.metrics = Metrics(self._engine_stats, lambda: self.cache_step.stats())
        self._active_ids: set[tuple[str, str]] = set()  # (tenant, request id) of running requests

    # -- lifecycle ---------------------------------------------------------
    def attach(self, engine: Any, cache: Any = None, embedder: Any = None) -> None:
        self.engine = engine
        self.cache_step = CacheStep(cache, embedder, self.cfg.cache)
        if not self.cfg.server.served_model_name:
            self.model_name = engine.engine.model_info.get("model") or self.cfg.engine.model
        self.serving = True

    def begin_drain(self) -> None:
        self.serving = False
        self.draining = True

    @property
    def num_active(self) -> int:
        return len(self._active_ids)

    async def close(self) -> None:
        await self.cache_step.close()

    def render_metrics(self) -> tuple[bytes, str]:
        return self.metrics.render()

    # -- auth ----------------------------------------------------------------
    def authenticate(self, authorization: Optional[str], peer: str = "") -> Caller:
        """The caller behind ``authorization``; ``peer`` (the client's address) is throttled after
        repeated failures."""
        if not self.auth.enabled:
            return Caller()
        wait = self.auth_throttle.wait(peer)
        if wait is not None:
            raise ServiceError("rate_limited", "too many failed API-key checks from this address; "
                               f"retry in {wait:.0f}s", retry_after_s=wait)
        try:
            key = self.auth.check(authorization)
        except AuthError as exc:
            if exc.guess:  # a missing or malformed header guesses nothing
                self.auth_throttle.failed(peer)
            raise ServiceError("unauthenticated", str(exc)) from None
        return Caller() if key is None else Caller(tenant=key.tenant, key_id=key.key_id)

    def _check_serving(self) -> None:
        if not self.serving:
            raise ServiceError("unavailable", "draining: the sidecar is shutting down" if self.draining
                               else "loading: the model is not ready yet")

    def _rate_limit(self, caller: Caller, tokens: int) -> None:
        wait = self.limiter.acquire(caller.key_id or "anonymous", tokens)
        if wait is not None:
            if wait == float("inf"):  # can never fit: retrying is pointless, so it is bad input
                raise invalid("sampling.max_tokens", f"request needs {tokens} tokens (prompt + max_tokens), more "
                              f"than the per-key limit of {self.limiter.tpm:g} tokens/min")
            raise ServiceError("rate_limited", f"rate limit exceeded; retry in {wait:.3f}s", retry_after_s=wait)

    # -- generation ----------------------------------------------------------
    def _encode(self, req: GenerationRequest) -> list[int]:
        """Prompt token ids (run in a worker thread: tokenizing a long prompt must not hold the loop)."""
        eng = self.engine.engine
        if req.messages is not None:
            try:
                return list(tools.chat_prompt(eng, req))
            except ValueError as exc:
                raise ServiceError("invalid_argument", str(exc), field="messages") from None
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        return list(eng.tokenizer.encode(req.prompt, add_special_tokens=True))

    def _fit_max_tokens(self, req: GenerationRequest, n_prompt: int) -> None:
        """A max_tokens the client set must fit the context next to the prompt (400 otherwise, as
        vLLM does); a defaulted one is lowered to the room left. With an output constraint (response
        format, tools) the default is the room left: a schema-bound reply cut at a small default is
        unusable, and on the OpenAI API unset means the rest of the context."""
        max_len = self.engine.engine.model_info.get("max_model_len")
        if not max_len or n_prompt >= max_len:
            return  # the engine refuses the prompt itself, naming it
        room = max_len - n_prompt
        if not req.max_tokens_set and req.params.structured is not None:
            req.params = dataclasses.replace(req.params, max_tokens=room)
        elif req.params.max_tokens > room:
            if req.max_tokens_set:
                raise invalid("sampling.max_tokens", f"{req.params.max_tokens} tokens plus the prompt's {n_prompt} "
                              f"exceed the context length of {max_len} tokens; at most {room} fit")
            req.params = dataclasses.replace(req.params, max_tokens=room)

    async def generate(self, caller: Caller, req: GenerationRequest) -> AsyncIterator[Event]:
        arrival = time.monotonic()  # queue time and TTFT count from here, as clients see them
        self._check_serving()
        info = self.engine.engine.model_info
        check_request(req, self.model_name, info.get("vocab_size"), self.cfg.server.max_prompt_chars)
        parser = tools.ToolCallParser() if req.messages is not None and tools.uses_tools(req) else None
        if req.messages is not None and req.tools is not None:
            tools.check_tools(req.tools, req.tool_choice)
            req.params = tools.chat_params(req)
        prompt = await asyncio.to_thread(self._encode, req)
        self._fit_max_tokens(req, len(prompt))
        key = caller.key_id or "anonymous"
        # A set max_tokens is charged up front and what is not generated refunded at the end; a
        # defaulted one (the rest of the context) is charged as generated, after the fact.
        upfront = req.params.max_tokens if req.max_tokens_set else 0
        self._rate_limit(caller, len(prompt) + upfront if self.limiter.tpm > 0 else 0)
        generated = 0

        plan = self.cache_step.plan(caller.tenant, req, self.model_name)
        hit = await self.cache_step.lookup(plan) if plan.policy.lookup else None
        rid = self._new_id(req.request_id, caller.tenant)
        if hit is not None:
            self.limiter.refund(key, upfront)
            log.info("request answered from the semantic cache", extra={
                "request_id": rid, "tenant": caller.tenant, "kind": hit.kind, "similarity": round(hit.similarity, 4)})
            ev = self._replay(rid, hit, plan.lookup_ms)
            yield tools.split_event(ev, parser) if parser else ev
            return
        if req.cache_control == "only":
            self.limiter.refund(key, upfront)
            raise ServiceError("cache_miss", "semantic cache miss")

        salt_parts = [p for p in (caller.tenant, req.cache_salt) if p]
        cache_salt = "\x1f".join(salt_parts) if salt_parts else None
        deadline = time.monotonic() + req.timeout_s if req.timeout_s is not None else None
        # Ids are scoped per tenant: the engine gets its own unique id, so a caller reusing another
        # tenant's in-flight id neither collides with it nor learns that it exists.
        engine_id = f"{uuid.uuid4().hex[:16]}:{rid}"[:128]
        self._active_ids.add((caller.tenant, rid))
        # Identical cacheable requests in flight share one generation (server/coalesce.py).
        stream = self.cache_step.engine_stream(plan, prompt, req.model, deadline, lambda: self.engine.generate(
            prompt, req.params, request_id=engine_id, priority=req.priority, cache_salt=cache_salt,
            deadline=deadline, arrival_time=arrival, tenant=caller.tenant))
        first = True
        queued = True  # the engine holds the request; ending without a final output is an abort
        try:
            try:
                out = await stream.__anext__()
            except ValueError as exc:
                queued = False
                raise ServiceError("invalid_argument", _field_message(str(exc))) from None
            except QueueFullError:
                queued = False
                raise ServiceError("queue_full", "waiting queue is full; retry later",
                                   retry_after_s=QUEUE_FULL_RETRY_S) from None
            except RuntimeError as exc:  # engine refuses new work while shutting down
                queued = False
                raise ServiceError("unavailable", f"draining: {exc}") from None
            except StopAsyncIteration:
                queued = False
                raise ServiceError("internal", "engine produced no output") from None
            while True:
                generated = len(out.token_ids)
                if out.finished and out.finish_reason == "abort":
                    queued = False
                    self.metrics.success.labels(finish_reason="abort").inc()
                    if out.abort_reason == "deadline":
                        raise ServiceError("deadline_exceeded", "deadline exceeded; request aborted")
                    if out.abort_reason == "shutdown":
                        raise ServiceError("unavailable", "draining: request aborted at shutdown")
                    raise ServiceError("internal", f"request aborted: {out.abort_reason}")
                ev = self._event(rid, out, plan.info)
                if parser is not None:
                    tools.split_event(ev, parser)
                if out.finished:
                    queued = False
                    self.metrics.observe_finished(out.finish_reason, out.queue_s, out.ttft_s, out.e2e_s,
                                                  len(out.token_ids))
                    if plan.policy.store and out.finish_reason in ("stop", "length"):
                        await self.cache_step.remember(plan, out)  # in memory before the answer leaves
                    log.info("request finished", extra={
                        "request_id": rid, "tenant": caller.tenant, "finish_reason": out.finish_reason,
                        "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                        "cached_tokens": out.num_cached_tokens, "ttft_ms": _round_ms(out.ttft_s),
                        "e2e_ms": _round_ms(out.e2e_s), "cache": plan.info.status})
                if first or out.finished or out.new_token_ids or out.delta_text:
                    first = False
                    yield ev
                if out.finished:
                    return
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    raise ServiceError("internal", "engine stream ended without a finished output") from None
                except RuntimeError as exc:  # engine stopped under a running request
                    raise ServiceError("unavailable", f"engine stopped: {exc}") from None
        finally:
            if queued:  # the client left (cancel, disconnect, closed stream): the engine aborts it
                self.metrics.success.labels(finish_reason="abort").inc()
            self._active_ids.discard((caller.tenant, rid))
            if req.max_tokens_set:
                self.limiter.refund(key, upfront - generated)
            else:
                self.limiter.charge(key, generated)
            await stream.aclose()

    def _new_id(self, wanted: Optional[str], tenant: str) -> str:
        base = wanted or f"req-{uuid.uuid4().hex[:16]}"
        rid = base
        # A caller reusing its own in-flight id gets a suffix, so its responses stay tellable apart.
        while (tenant, rid) in self._active_ids:
            rid = f"{base}-{uuid.uuid4().hex[:6]}"
        return rid

    def _event(self, rid: str, out: Any, cache: CacheInfo) -> Event:
        return Event(
            request_id=rid, delta_text=out.delta_text, new_token_ids=list(out.new_token_ids),
            new_logprobs=out.new_logprobs, finished=out.finished, finish_reason=out.finish_reason,
            text=out.text, token_ids=list(out.token_ids), prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
            queue_ms=_ms(out.queue_s), ttft_ms=_ms(out.ttft_s), total_ms=_ms(out.e2e_s), cache=cache)

    def _replay(self, rid: str, hit: Any, lookup_ms: float) -> Event:
        self.metrics.success.labels(finish_reason=hit.finish_reason).inc()
        return Event(
            request_id=rid, delta_text=hit.text, new_token_ids=list(hit.token_ids), new_logprobs=None,
            finished=True, finish_reason=hit.finish_reason, text=hit.text, token_ids=list(hit.token_ids),
            prompt_tokens=hit.prompt_tokens, completion_tokens=hit.completion_tokens, cached_tokens=0,
            queue_ms=0.0, ttft_ms=lookup_ms, total_ms=lookup_ms,
            cache=CacheInfo(status="hit_exact" if hit.kind == "exact" else "hit_semantic",
                            similarity=float(hit.similarity), matched_query=hit.matched_query))

    # -- other calls ---------------------------------------------------------
    async def embed(self, caller: Caller, inputs: list[str]) -> tuple[list[list[float]], int]:
        self._check_serving()
        if not isinstance(inputs, list) or not inputs:
            raise ServiceError("invalid_argument", "inputs: at least one text is required", field="inputs")
        if len(inputs) > 256:
            raise ServiceError("invalid_argument", f"inputs: at most 256 texts, got {len(inputs)}", field="inputs")
        limit = self.cfg.server.max_prompt_chars
        chars = 0
        for i, t in enumerate(inputs):
            if not isinstance(t, str) or not t.strip():
                raise ServiceError("invalid_argument", f"inputs[{i}]: must be a non-empty string", field="inputs")
            check_text(f"inputs[{i}]", t)
            chars += len(t)
        if chars > limit:  # the same bound prompts have: tokenizing is linear but not free
            raise ServiceError("invalid_argument", f"inputs: {chars} characters in total, more than {limit}",
                               field="inputs")
        embedder = await self.cache_step.get_embedder()
        n_tokens = await asyncio.to_thread(embedder.count_tokens, inputs)
        self._rate_limit(caller, n_tokens)
        vecs = await embedder.aembed(inputs)
        return [v.tolist() for v in vecs], n_tokens

    async def tokenize(self, caller: Caller, text: Optional[str], messages: Optional[list[dict]],
                       add_special_tokens: bool, tool_specs: Optional[list] = None) -> tuple[list[int], list[str]]:
        """Token ids and their strings (``messages`` rendered with ``tool_specs`` as Chat would). Same
        prompt limits and rate limits as generation; the tokenizer runs in a worker thread, so a huge
        text never holds the event loop."""
        self._check_serving()
        eng = self.engine.engine
        limit = self.cfg.server.max_prompt_chars
        if text and messages:
            raise ServiceError("invalid_argument", "text: set either text or messages, not both", field="text")
        if messages:  # roles and order are the template's business (encode_chat checks them)
            for i, m in enumerate(messages):
                check_text(f"messages[{i}].content", m["content"])
            chars = sum(len(m["content"]) for m in messages)
            if chars > limit:
                raise invalid("messages", f"total content is {chars} characters, more than {limit}")
            if tool_specs:
                tools.check_tools(tool_specs, "auto")
        elif not text:
            raise ServiceError("invalid_argument", "text: set text or messages", field="text")
        else:
            check_text("text", text)
            if len(text) > limit:
                raise invalid("text", f"{len(text)} characters, more than {limit}")

        def work() -> tuple[list[int], list[str]]:
            if messages:
                ids = list(tools.chat_prompt(eng, GenerationRequest(messages=messages, tools=tool_specs)))
            else:
                ids = list(eng.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            return ids, self.token_strings(ids)

        try:
            ids, strings = await asyncio.to_thread(work)
        except ValueError as exc:
            raise ServiceError("invalid_argument", str(exc), field="messages") from None
        self._rate_limit(caller, len(ids))
        return ids, strings

    def token_strings(self, ids: list[int]) -> list[str]:
        tok = self.engine.engine.tokenizer
        return [tok.decode([i]) for i in ids]

    def model_info(self) -> dict:
        info = dict(self.engine.engine.model_info) if self.engine is not None else {}
        from sidecar import __version__

        info.update(model=self.model_name, version=__version__, semantic_cache=self.cache_step.cache is not None,
                    embedding_model=self.cache_step.embedding_model_name(),
                    embedding_dimensions=self.cache_step.embedding_dim())
        return info

    def _engine_stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else {}

    def stats(self) -> dict:
        s = dict(self._engine_stats())
        c = self.cache_step.stats() or {}
        s.update(semantic_cache_lookups=c.get("lookups", 0),
                 semantic_cache_hits=c.get("exact_hits", 0) + c.get("semantic_hits", 0),
                 semantic_cache_entries=c.get("entries", 0))
        return s


def _field_message(msg: str) -> str:
    """Engine errors name SamplingParams fields bare; the wire names them under ``sampling.``."""
    from sidecar.server.validation import SAMPLING_FIELDS

    name = msg.split(":", 1)[0]
    return f"sampling.{msg}" if name in SAMPLING_FIELDS else msg
