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
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from sidecar.config import SidecarConfig
from sidecar.engine.request import QueueFullError, RequestOutput, SamplingParams
from sidecar.server import harmony, reasoning, tool_formats, tools
from sidecar.server.admin import LOAD_LORA, UNLOAD_LORA, AdapterScopes, LoraRoots, audit
from sidecar.server.cache_step import CacheInfo, CacheStep, Plan
from sidecar.server.metrics import Metrics
from sidecar.server.structured_check import check_constraint
from sidecar.server.security import AuthError, AuthThrottle, Authenticator, RateLimiter, load_api_keys
from sidecar.server.validation import (
    SAMPLING_FIELDS,
    ServiceError,
    check_request,
    check_text,
    invalid,
    sampling_params,
)

if TYPE_CHECKING:  # the engine (and torch) load after the servers bind, in app.py
    from sidecar.engine.async_engine import AsyncEngine

log = logging.getLogger("sidecar.service")

__all__ = [
    "ServiceError",
    "Caller",
    "GenerationRequest",
    "CacheInfo",
    "Event",
    "InferenceService",
    "sampling_params",
]

QUEUE_FULL_RETRY_S = 0.5
LOADING = "loading: the model is not ready yet"


@dataclass
class Caller:
    tenant: str = ""
    key_id: Optional[str] = None
    operator: bool = False  # may run operator actions: an operator key, or any caller while auth is off


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
    # Chat only: extra chat-template variables, and OpenAI's reasoning_effort (sidecar.server.reasoning).
    chat_template_kwargs: Optional[dict] = None
    reasoning_effort: Optional[str] = None


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
    # A thinking model's reasoning (its think block without the markers): new in this event, so far, and
    # the generated tokens it took. ``text`` / ``delta_text`` then hold the answer only.
    reasoning_delta: str = ""
    reasoning_text: str = ""
    reasoning_tokens: int = 0
    beams: Optional[list] = None  # beam search: every hypothesis (engine BeamSequence), best first


@dataclass
class TokenCharge:
    """A request's rate-limit charge: ``upfront`` tokens were taken at admission (a set max_tokens);
    ``settle`` refunds what was not generated, or charges what was when max_tokens was defaulted."""

    key: str
    upfront: int
    max_tokens_set: bool

    def settle(self, limiter: RateLimiter, generated: int) -> None:
        if self.max_tokens_set:
            limiter.refund(self.key, self.upfront - generated)
        else:
            limiter.charge(self.key, generated)


@dataclass(frozen=True)
class Admission:
    """What admission decided for one request; the engine runs exactly this."""

    prompt_ids: list[int]
    params: SamplingParams  # the request's, with the tool-call grammar folded in and max_tokens fitted
    parser: Any  # splits tool-call markup out of the text (tool requests; tools.make_parser), or None
    charge: TokenCharge
    lora: Optional[str] = None  # the LoRA adapter the request names, None for the base model
    # splits a thinking model's reasoning off (a harmony.HarmonyParser for gpt-oss's channels)
    reasoning: Optional[reasoning.ReasoningParser] = None
    template_kwargs: Optional[dict] = None  # the chat-template variables the prompt was rendered with


@dataclass
class _Progress:
    """How far the engine got with a request, read when the request ends however it ends."""

    generated: int = 0
    held: bool = True  # the engine holds the request: ending now is the client's abort
    yielded: bool = False


def _fit_max_tokens(
    params: SamplingParams,
    max_tokens_set: bool,
    n_prompt: int,
    max_len: Optional[int],
    structured_default: Optional[int] = None,
) -> SamplingParams:
    """A max_tokens the client set must fit the context next to the prompt (400 otherwise, as
    vLLM does); a defaulted one is lowered to the room left. With an output constraint (response
    format, tools) the default is the room left: a schema-bound reply cut at a small default is
    unusable, and on the OpenAI API unset means the rest of the context -- except where
    ``structured_default`` bounds it (forced tool calls: enough for the calls, not a runaway)."""
    if not max_len or n_prompt >= max_len:
        return params  # the engine refuses the prompt itself, naming it
    room = max_len - n_prompt
    if not max_tokens_set and params.structured is not None:
        return dataclasses.replace(params, max_tokens=min(room, structured_default or room))
    if params.max_tokens > room:
        if max_tokens_set:
            raise invalid(
                "sampling.max_tokens",
                f"{params.max_tokens} tokens plus the prompt's {n_prompt} "
                f"exceed the context length of {max_len} tokens; at most {room} fit",
            )
        return dataclasses.replace(params, max_tokens=room)
    return params


async def _service_errors(
    stream: AsyncIterator[RequestOutput], progress: _Progress
) -> AsyncIterator[RequestOutput]:
    """``stream``'s outputs, with the engine's refusals and failures raised as ServiceErrors. A refusal
    (before any output) means the engine never held the request."""
    started = False
    try:
        async for out in stream:
            started = True
            yield out
    except QueueFullError:  # before RuntimeError: it is one
        progress.held = False
        raise ServiceError(
            "queue_full", "waiting queue is full; retry later", retry_after_s=QUEUE_FULL_RETRY_S
        ) from None
    except ValueError as exc:
        progress.held = False
        raise ServiceError("invalid_argument", _field_message(str(exc))) from None
    except LookupError as exc:  # the adapter was unloaded after admission
        progress.held = False
        raise ServiceError("not_found", str(exc), field="model") from None
    except RuntimeError as exc:  # refusing new work while shutting down, or stopped under a request
        progress.held = progress.held and started
        raise ServiceError(
            "unavailable", f"engine stopped: {exc}" if started else f"draining: {exc}"
        ) from None
    if not started:
        progress.held = False
        raise ServiceError("internal", "engine produced no output")
    raise ServiceError("internal", "engine stream ended without a finished output")


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else s * 1000.0


def _round_ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else round(s * 1000.0, 2)


class InferenceService:
    """Created before the model loads (``serving`` False); ``attach`` makes it serve."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.engine: Optional[AsyncEngine] = None  # set by attach
        self.cache_step = CacheStep(None, None, cfg.cache)
        self.serving = False
        self.draining = False
        self.model_name = cfg.server.served_model_name or cfg.engine.model
        s = cfg.server
        self.auth = Authenticator(load_api_keys(s.api_keys, s.api_keys_file, s.admin_keys, s.admin_keys_file))
        self.lora_roots = LoraRoots(s.lora_roots)
        self.adapters = AdapterScopes()
        self.auth_throttle = AuthThrottle(cfg.server.auth_failures_per_min)
        self.limiter = RateLimiter(
            cfg.server.rate_limit_rps, cfg.server.rate_limit_burst, cfg.server.rate_limit_tpm
        )
        # Late-bound: attach() replaces cache_step once the cache has loaded.
        self.metrics = Metrics(self._engine_stats, lambda: self.cache_step.stats())
        self._active_ids: set[tuple[str, str]] = set()  # (tenant, request id) of running requests

    # -- lifecycle ---------------------------------------------------------
    def attach(self, engine: AsyncEngine, cache: Any = None, embedder: Any = None) -> None:
        self.engine = engine
        self.cache_step = CacheStep(cache, embedder, self.cfg.cache)
        if not self.cfg.server.served_model_name:
            self.model_name = engine.model_info.get("model") or self.cfg.engine.model
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
        """The caller behind ``authorization``. A configured key is accepted whatever its address did:
        callers of a sidecar share an address (one pod, one gateway), so another caller's wrong keys
        must not lock them out. Wrong keys from an address that failed too often are answered
        ``rate_limited`` instead of ``unauthenticated``; keys must carry enough entropy that guessing
        them is hopeless anyway (the throttle bounds the noise and work, not the odds)."""
        if not self.auth.enabled:
            return Caller(operator=True)
        try:
            key = self.auth.check(authorization)
        except AuthError as exc:
            wait = self.auth_throttle.wait(peer)
            if exc.guess:  # a missing or malformed header guesses nothing
                self.auth_throttle.failed(peer)
            if wait is not None:
                raise ServiceError(
                    "rate_limited",
                    f"too many failed API-key checks from this address; retry in {wait:.0f}s",
                    retry_after_s=wait,
                ) from None
            raise ServiceError("unauthenticated", str(exc)) from None
        if key is None:
            return Caller(operator=True)
        return Caller(tenant=key.tenant, key_id=key.key_id, operator=key.operator)

    def require_operator(self, caller: Caller, action: str) -> None:
        """Refuse ``action`` (permission_denied naming it) unless ``caller`` may run operator actions; a
        refusal is counted and audited. Transports call it before reading the request, so a tenant
        learns nothing from how its request would have been parsed."""
        if caller.operator:
            return
        self.metrics.operator_refused.labels(action=action, reason="permission").inc()
        audit(caller, action, "permission_denied")
        raise ServiceError(
            "permission_denied",
            f"permission denied: {action} is an operator action and needs an operator key "
            "(--admin-key); this is a tenant key",
        )

    def _check_serving(self) -> None:
        if not self.serving:
            raise ServiceError(
                "unavailable", "draining: the sidecar is shutting down" if self.draining else LOADING
            )

    def check_loaded(self) -> None:
        """Raise ``unavailable`` until the model has loaded (it stays loaded while draining)."""
        if self.engine is None:
            raise ServiceError("unavailable", LOADING)

    def _engine(self) -> AsyncEngine:
        """The engine, for a request that passed ``_check_serving``."""
        if self.engine is None:
            raise ServiceError("unavailable", LOADING)
        return self.engine

    def _model_info(self) -> dict:
        return self.engine.model_info if self.engine is not None else {}

    def _rate_limit(self, caller: Caller, tokens: int) -> None:
        wait = self.limiter.acquire(caller.key_id or "anonymous", tokens)
        if wait is not None:
            if wait == float("inf"):  # can never fit: retrying is pointless, so it is bad input
                raise invalid(
                    "sampling.max_tokens",
                    f"request needs {tokens} tokens (prompt + max_tokens), more "
                    f"than the per-key limit of {self.limiter.tpm:g} tokens/min",
                )
            raise ServiceError(
                "rate_limited", f"rate limit exceeded; retry in {wait:.3f}s", retry_after_s=wait
            )

    # -- generation ----------------------------------------------------------
    # One request runs three phases with explicit data between them:
    #   _admit (validate, encode, fit, charge)  -> Admission
    #   _answer_from_cache (plan, lookup)       -> a cached Event, or None to go on
    #   _run_engine (stream, record, store)     -> Events
    # However a request ends, its rate-limit charge is settled once and the engine stream closed.

    async def generate(self, caller: Caller, req: GenerationRequest) -> AsyncIterator[Event]:
        """The request's events, the last one ``finished``; raises ServiceError on refusal or failure.
        ``req`` is only read."""
        arrival = time.monotonic()  # queue time and TTFT count from here, as clients see them
        admission = await self._admit(caller, req)
        # Counted as a user of its adapter until it ends: an adapter in use is never unloaded.
        self.adapters.hold(admission.lora)
        try:
            rid = self._new_id(req.request_id, caller.tenant)
            # The adapter is part of the semantic cache's scope: its answers are never another model's.
            plan = self.cache_step.plan(
                caller.tenant,
                req,
                admission.params,
                admission.lora or self.model_name,
                admission.template_kwargs,
            )
            cached = await self._answer_from_cache(caller, req, rid, plan, admission)
            if cached is not None:
                yield cached
                return
            async for ev in self._run_engine(caller, req, rid, plan, admission, arrival):
                yield ev
        finally:
            self.adapters.release(admission.lora)

    async def _admit(self, caller: Caller, req: GenerationRequest) -> Admission:
        """Validate ``req``, encode its prompt, settle its sampling parameters and charge the caller's
        rate limit. Nothing is held yet when this raises."""
        self._check_serving()
        info = self._model_info()
        lora = self._adapter(caller, req.model)
        check_request(req, lora or self.model_name, info.get("vocab_size"), self.cfg.server.max_prompt_chars)
        is_chat = req.messages is not None
        template = self._engine().chat_template
        channels = is_chat and harmony.is_harmony(template)  # gpt-oss: reasoning and calls in channels
        fmt = tool_formats.detect(template) if is_chat else None
        parser = tools.make_parser(fmt) if is_chat and tools.uses_tools(req) and not channels else None
        if is_chat and req.tools is not None:
            tools.check_tools(req.tools, req.tool_choice)
        thinks = is_chat and not channels and reasoning.thinks(template)
        tpl = (
            reasoning.template_kwargs(req.chat_template_kwargs, req.reasoning_effort, thinks)
            if is_chat
            else {}
        )
        tpl = harmony.template_kwargs(tpl, req.reasoning_effort) if channels else tpl
        # The tool-call grammar is compiled (checked) in the worker thread, with the prompt's encoding.
        params, prompt, opened = await asyncio.to_thread(self._prepare, req, tpl, thinks, channels)
        if channels:  # the parser reads the channel markers, which are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        await self._compile_grammar(params.structured)
        tool_default = (
            tools.default_tool_max_tokens(req.tool_choice, req.parallel_tool_calls)
            if is_chat and tools.uses_tools(req)
            else None
        )
        params = _fit_max_tokens(
            params, req.max_tokens_set, len(prompt), info.get("max_model_len"), tool_default
        )
        # A set max_tokens is charged up front and what is not generated refunded at the end; a
        # defaulted one (the rest of the context) is charged as generated, after the fact.
        charge = TokenCharge(
            caller.key_id or "anonymous", params.max_tokens if req.max_tokens_set else 0, req.max_tokens_set
        )
        self._rate_limit(caller, len(prompt) + charge.upfront if self.limiter.tpm > 0 else 0)
        think = reasoning.ReasoningParser(opened, self.token_strings) if thinks else None
        think = harmony.HarmonyParser(self.token_strings, tools.uses_tools(req)) if channels else think
        return Admission(prompt, params, parser, charge, lora, think, tpl or None)

    async def _compile_grammar(self, c: Any) -> None:
        """Have the engine compile and try the request's constraint before it is admitted (off the event loop
        and the engine thread); one that cannot be enforced is refused naming the field it came from."""
        if c is None:
            return
        try:
            await self._engine().compile_grammar(c)
        except ValueError as exc:
            raise invalid(
                getattr(c, "origin", "") or "structured", str(exc).removeprefix("structured: ")
            ) from None

    def _adapter(self, caller: Caller, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter ``model`` names; None for the base model (its name or none). Raises not_found
        naming ``model`` when it is neither, or an adapter of another tenant (the same answer)."""
        if not model or model == self.model_name:
            return None
        adapters = self.adapters.visible(self._engine().lora_adapters(), caller.tenant)
        if model not in adapters:
            known = ", ".join(repr(n) for n in [self.model_name, *adapters])
            raise ServiceError(
                "not_found", f"model: unknown model {model!r}; this sidecar serves {known}", field="model"
            )
        return model

    def _prepare(
        self, req: GenerationRequest, template_kwargs: dict, thinks: bool = False, channels: bool = False
    ) -> tuple[SamplingParams, list[int], bool]:
        """The request's params with any tool-call grammar (in the model's format) folded in, its prompt ids,
        and whether the prompt opens a think block (worker thread). A thinking model's output constraint
        lets the think block come first, so reasoning is not forced into the answer's shape. A harmony
        model (``channels``) writes its calls in its own channel, held to one only where tool_choice
        forces a call."""
        params = req.params
        engine = self._engine()
        if req.messages is not None and req.tools is not None:
            fmt = tool_formats.detect(engine.chat_template)
            markers = harmony.MARKERS if channels else [m for m in (fmt.start, fmt.end) if m]
            special = {m: i for m in markers if (i := engine.special_token_id(m)) is not None}
            params = harmony.chat_params(req, special) if channels else tools.chat_params(req, fmt, special)
        prompt = self._encode(req, template_kwargs)
        opened = thinks and reasoning.opens_block("".join(engine.token_strings(prompt[-8:])))
        c = params.structured
        if thinks and reasoning.needs_think_first(c, opened):
            wrapped = check_constraint(reasoning.think_first(c, opened), c.origin or "structured")
            params = dataclasses.replace(params, structured=wrapped)
        return params, prompt, opened

    def _encode(self, req: GenerationRequest, template_kwargs: Optional[dict] = None) -> list[int]:
        """Prompt token ids (run in a worker thread: tokenizing a long prompt must not hold the loop)."""
        if req.messages is not None:
            try:
                return tools.chat_prompt(self._engine(), req, template_kwargs)
            except ValueError as exc:
                raise ServiceError("invalid_argument", str(exc), field="messages") from None
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        return self._engine().tokenize(req.prompt or "", add_special_tokens=True)

    async def _answer_from_cache(
        self, caller: Caller, req: GenerationRequest, rid: str, plan: Plan, admission: Admission
    ) -> Optional[Event]:
        """The cached answer to ``req``, or None when the engine must generate it. A cached answer costs
        no tokens (the up-front charge is refunded); ``cache_control=only`` turns a miss into an error."""
        hit = await self.cache_step.lookup(plan) if plan.policy.lookup else None
        if hit is None and req.cache_control != "only":
            return None
        self.limiter.refund(admission.charge.key, admission.charge.upfront)
        if hit is None:
            raise ServiceError("cache_miss", "semantic cache miss")
        log.info(
            "request answered from the semantic cache",
            extra={
                "request_id": rid,
                "tenant": caller.tenant,
                "kind": hit.kind,
                "similarity": round(hit.similarity, 4),
            },
        )
        return _split(self._replay(rid, hit, plan.lookup_ms), admission)

    async def _run_engine(
        self,
        caller: Caller,
        req: GenerationRequest,
        rid: str,
        plan: Plan,
        admission: Admission,
        arrival: float,
    ) -> AsyncIterator[Event]:
        """Generate in the engine and turn its outputs into events. The first event, the last one and
        every one that carries text or tokens are yielded."""
        salt_parts = [p for p in (caller.tenant, req.cache_salt) if p]
        deadline = time.monotonic() + req.timeout_s if req.timeout_s is not None else None
        # Ids are scoped per tenant: the engine gets its own unique id, so a caller reusing another
        # tenant's in-flight id neither collides with it nor learns that it exists.
        engine_id = f"{uuid.uuid4().hex[:16]}:{rid}"[:128]
        self._active_ids.add((caller.tenant, rid))
        # Identical cacheable requests in flight share one generation (server/coalesce.py).
        stream = self.cache_step.engine_stream(
            plan,
            admission.prompt_ids,
            req.model,
            deadline,
            lambda: self._engine().generate(
                admission.prompt_ids,
                admission.params,
                request_id=engine_id,
                priority=req.priority,
                cache_salt="\x1f".join(salt_parts) if salt_parts else None,
                deadline=deadline,
                arrival_time=arrival,
                tenant=caller.tenant,
                lora=admission.lora,
            ),
        )
        progress = _Progress()
        outputs = _service_errors(stream, progress)
        try:
            async for out in outputs:
                progress.generated = len(out.token_ids)
                if out.finished:
                    progress.held = False
                    self._refuse_aborted(out, admission.params.structured)
                ev = _split(self._event(rid, out, plan.info), admission)
                if out.finished:
                    await self._record_finished(caller, rid, out, plan)
                if not progress.yielded or out.finished or out.new_token_ids or out.delta_text:
                    progress.yielded = True
                    yield ev
                if out.finished:
                    return
        finally:
            if progress.held:  # the client left (cancel, disconnect, closed stream): the engine aborts it
                self.metrics.success.labels(finish_reason="abort").inc()
            self._active_ids.discard((caller.tenant, rid))
            admission.charge.settle(self.limiter, progress.generated)
            await outputs.aclose()
            await stream.aclose()

    def _refuse_aborted(self, out: RequestOutput, constraint: Any = None) -> None:
        """An engine-side abort (deadline, shutdown, error) ends the request with its ServiceError; a
        constraint that broke while decoding names the field it came from."""
        if out.finish_reason != "abort":
            return
        self.metrics.success.labels(finish_reason="abort").inc()
        if out.abort_reason == "deadline":
            raise ServiceError("deadline_exceeded", "deadline exceeded; request aborted")
        if out.abort_reason == "shutdown":
            raise ServiceError("unavailable", "draining: request aborted at shutdown")
        if (out.abort_reason or "").startswith("error: TPWorkerLost: "):  # the server stops and restarts
            raise ServiceError("unavailable", f"engine stopped: {out.abort_reason.removeprefix('error: ')}")
        if (out.abort_reason or "").startswith("error: structured: "):  # the request's own constraint
            field_name = getattr(constraint, "origin", "") or "structured"
            raise invalid(field_name, out.abort_reason.removeprefix("error: structured: "))
        raise ServiceError("internal", f"request aborted: {out.abort_reason}")

    async def _record_finished(self, caller: Caller, rid: str, out: RequestOutput, plan: Plan) -> None:
        """Metrics and the log line of a finished request; a cacheable answer is in the cache's in-memory
        tiers before its last event leaves (persistence follows on the cache's writer thread)."""
        self.metrics.observe_finished(
            out.finish_reason, out.queue_s, out.ttft_s, out.e2e_s, len(out.token_ids)
        )
        if plan.policy.store and out.finish_reason in ("stop", "length"):
            await self.cache_step.remember(plan, out)
        log.info(
            "request finished",
            extra={
                "request_id": rid,
                "tenant": caller.tenant,
                "finish_reason": out.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(out.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "ttft_ms": _round_ms(out.ttft_s),
                "e2e_ms": _round_ms(out.e2e_s),
                "cache": plan.info.status,
            },
        )

    def _new_id(self, wanted: Optional[str], tenant: str) -> str:
        base = wanted or f"req-{uuid.uuid4().hex[:16]}"
        rid = base
        # A caller reusing its own in-flight id gets a suffix, so its responses stay tellable apart.
        while (tenant, rid) in self._active_ids:
            rid = f"{base}-{uuid.uuid4().hex[:6]}"
        return rid

    def _event(self, rid: str, out: Any, cache: CacheInfo) -> Event:
        return Event(
            request_id=rid,
            delta_text=out.delta_text,
            new_token_ids=list(out.new_token_ids),
            new_logprobs=out.new_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            text=out.text,
            token_ids=list(out.token_ids),
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
            cached_tokens=out.num_cached_tokens,
            queue_ms=_ms(out.queue_s),
            ttft_ms=_ms(out.ttft_s),
            total_ms=_ms(out.e2e_s),
            cache=cache,
            beams=getattr(out, "beams", None),
        )

    def _replay(self, rid: str, hit: Any, lookup_ms: float) -> Event:
        self.metrics.success.labels(finish_reason=hit.finish_reason).inc()
        return Event(
            request_id=rid,
            delta_text=hit.text,
            new_token_ids=list(hit.token_ids),
            new_logprobs=None,
            finished=True,
            finish_reason=hit.finish_reason,
            text=hit.text,
            token_ids=list(hit.token_ids),
            prompt_tokens=hit.prompt_tokens,
            completion_tokens=hit.completion_tokens,
            cached_tokens=0,
            queue_ms=0.0,
            ttft_ms=lookup_ms,
            total_ms=lookup_ms,
            cache=CacheInfo(
                status="hit_exact" if hit.kind == "exact" else "hit_semantic",
                similarity=float(hit.similarity),
                matched_query=hit.matched_query,
            ),
        )

    # -- other calls ---------------------------------------------------------
    def check_embedding_model(self, name: Optional[str]) -> None:
        """Embeddings answer to the embedder's name, the configured embedding model and the served model's
        name (clients that send their chat model's name); empty means the default."""
        known = self.cache_step.embedding_model_name()
        if name and name not in (known, self.cfg.cache.embedding_model, self.model_name):
            raise ServiceError(
                "not_found",
                f"model: unknown embedding model {name!r}; embeddings come from "
                f"{known or self.cfg.cache.embedding_model!r}",
                field="model",
            )

    async def embed(
        self, caller: Caller, inputs: list[str], model: Optional[str] = None
    ) -> tuple[list[list[float]], int]:
        """Embedding vectors of ``inputs`` and their token count; ``model`` must name the embedding model
        (see ``check_embedding_model``)."""
        self._check_serving()
        self.check_embedding_model(model)
        _check_inputs(inputs, self.cfg.server.max_prompt_chars)
        embedder = await self.cache_step.get_embedder()
        n_tokens = await asyncio.to_thread(embedder.count_tokens, inputs)
        self._rate_limit(caller, n_tokens)
        vecs = await embedder.aembed(inputs)
        return [v.tolist() for v in vecs], n_tokens

    async def tokenize(
        self,
        caller: Caller,
        text: Optional[str],
        messages: Optional[list[dict]],
        add_special_tokens: bool,
        tool_specs: Optional[list] = None,
    ) -> tuple[list[int], list[str]]:
        """Token ids and their strings (``messages`` rendered with ``tool_specs`` as Chat would). Same
        prompt limits and rate limits as generation; the tokenizer runs in a worker thread, so a huge
        text never holds the event loop."""
        self._check_serving()
        _check_tokenize_input(text, messages, tool_specs, self.cfg.server.max_prompt_chars)
        engine = self._engine()

        def work() -> tuple[list[int], list[str]]:
            if messages:
                ids = tools.chat_prompt(engine, GenerationRequest(messages=messages, tools=tool_specs))
            else:
                ids = engine.tokenize(text or "", add_special_tokens=add_special_tokens)
            return ids, engine.token_strings(ids)

        try:
            ids, strings = await asyncio.to_thread(work)
        except ValueError as exc:
            raise ServiceError("invalid_argument", str(exc), field="messages") from None
        self._rate_limit(caller, len(ids))
        return ids, strings

    def token_strings(self, ids: list[int]) -> list[str]:
        return self._engine().token_strings(ids)

    def model_info(self, caller: Optional[Caller] = None) -> dict:
        """The model's facts plus the service's: served name, version, semantic cache, embedding model
        (only the service's part before the model has loaded), and the adapters ``caller`` may name (without
        a caller: the global ones)."""
        from sidecar import __version__

        info = self._model_info()
        info.update(
            model=self.model_name,
            version=__version__,
            semantic_cache=self.cache_step.cache is not None,
            embedding_model=self.cache_step.embedding_model_name(),
            embedding_dimensions=self.cache_step.embedding_dim(),
            lora_adapters=self.adapters.visible(
                self.engine.lora_adapters() if self.engine is not None else {},
                caller.tenant if caller is not None else None,
            ),
            reasoning=self.engine is not None
            and (
                reasoning.thinks(self.engine.chat_template) or harmony.is_harmony(self.engine.chat_template)
            ),
            tool_call_format=tool_formats.detect(self.engine.chat_template).name if self.engine else "",
        )
        return info

    # -- LoRA adapters at run time (operator actions: see sidecar.server.admin) ------------------------
    async def _audited(self, caller: Caller, action: str, work: Any, **details: Any) -> None:
        """Run operator action ``work()`` for ``caller`` and audit it once, whatever its result."""
        self.require_operator(caller, action)
        try:
            await work()
        except ServiceError as exc:
            audit(caller, action, exc.code, error=exc.message, **details)
            raise
        except asyncio.CancelledError:  # the caller left; the action may or may not have taken effect
            audit(caller, action, "cancelled", **details)
            raise
        except BaseException:
            audit(caller, action, "internal", **details)
            raise
        audit(caller, action, "ok", **details)

    async def load_lora(self, caller: Caller, name: str, path: str, tenant: Optional[str] = None) -> None:
        """Serve the PEFT adapter at ``path`` (a directory under a ``--lora-root``) as model ``name``, to every
        tenant or, with ``tenant``, to that tenant alone. An operator action. Raises ServiceError:
        permission_denied for a tenant key; invalid_argument naming lora_name / lora_path / tenant (bad name,
        taken, a path outside the roots, malformed or incompatible adapter, unknown tenant)."""

        async def work() -> None:
            self._check_serving()
            if not isinstance(name, str) or not name or name == self.model_name:
                raise invalid(
                    "lora_name", f"must be a non-empty name other than the base model's, got {name!r}"
                )
            if not isinstance(path, str) or not path:
                raise invalid("lora_path", "must be the path of a PEFT adapter directory")
            self._check_tenant(tenant)
            try:
                real = self.lora_roots.resolve(path)
            except ServiceError:
                self.metrics.operator_refused.labels(action=LOAD_LORA, reason="lora_root").inc()
                raise
            try:
                await self._engine().load_lora(name, real)
            except ValueError as exc:  # AdapterError names the file and field; the rest name lora_name / lora
                msg = str(exc)
                raise ServiceError(
                    "invalid_argument", msg, field="lora_name" if msg.startswith("lora") else "lora_path"
                ) from None
            if tenant:
                self.adapters.owner[name] = tenant

        await self._audited(caller, LOAD_LORA, work, lora_name=name, lora_path=path, lora_tenant=tenant)

    def _check_tenant(self, tenant: Optional[str]) -> None:
        """A tenant-scoped adapter names a tenant some configured key belongs to."""
        if tenant is None:
            return
        if not self.auth.enabled:
            raise invalid("tenant", "tenant-scoped adapters need API keys (--api-key KEY:TENANT)")
        if tenant not in self.auth.tenants():
            raise invalid("tenant", f"no configured API key belongs to tenant {tenant!r}")

    async def unload_lora(self, caller: Caller, name: str) -> None:
        """Stop serving adapter ``name``. An operator action. Raises ServiceError: permission_denied for a
        tenant key; failed_precondition naming lora_name while requests are using it (retry once they have
        finished); not_found naming lora_name when no adapter has that name."""

        async def work() -> None:
            self._check_serving()
            self.adapters.begin_unload(name)
            removed = False
            try:
                await self._engine().unload_lora(name)
                removed = True
            except LookupError as exc:
                raise ServiceError("not_found", str(exc), field="lora_name") from None
            finally:
                self.adapters.end_unload(name, removed)

        await self._audited(caller, UNLOAD_LORA, work, lora_name=name)

    def _engine_stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else {}

    def stats(self) -> dict:
        s = dict(self._engine_stats())
        c = self.cache_step.stats() or {}
        s.update(
            semantic_cache_lookups=c.get("lookups", 0),
            semantic_cache_hits=c.get("exact_hits", 0) + c.get("semantic_hits", 0),
            semantic_cache_entries=c.get("entries", 0),
        )
        return s


def _split(ev: Event, admission: Admission) -> Event:
    """A thinking model's reasoning, then tool-call markup, moved out of the event's text (in place)."""
    if admission.reasoning is not None:
        reasoning.split_event(ev, admission.reasoning)
        if isinstance(admission.reasoning, harmony.HarmonyParser):
            harmony.split_calls(ev, admission.reasoning)
    if admission.parser is not None:
        tools.split_event(ev, admission.parser)
    return ev


def _check_inputs(inputs: Any, max_chars: int) -> None:
    """Texts to embed: 1 to 256 non-empty strings, at most ``max_chars`` in total (the bound prompts
    have: tokenizing is linear but not free)."""
    if not isinstance(inputs, list) or not inputs:
        raise ServiceError("invalid_argument", "inputs: at least one text is required", field="inputs")
    if len(inputs) > 256:
        raise ServiceError(
            "invalid_argument", f"inputs: at most 256 texts, got {len(inputs)}", field="inputs"
        )
    chars = 0
    for i, t in enumerate(inputs):
        if not isinstance(t, str) or not t.strip():
            raise ServiceError("invalid_argument", f"inputs[{i}]: must be a non-empty string", field="inputs")
        check_text(f"inputs[{i}]", t)
        chars += len(t)
    if chars > max_chars:
        raise ServiceError(
            "invalid_argument", f"inputs: {chars} characters in total, more than {max_chars}", field="inputs"
        )


def _check_tokenize_input(
    text: Optional[str], messages: Optional[list[dict]], tool_specs: Optional[list], max_chars: int
) -> None:
    """Exactly one of ``text`` and ``messages``, within the prompt limit; roles and order are the
    template's business (encode_chat checks them)."""
    if text and messages:
        raise ServiceError("invalid_argument", "text: set either text or messages, not both", field="text")
    if messages:
        for i, m in enumerate(messages):
            check_text(f"messages[{i}].content", m["content"])
        chars = sum(len(m["content"]) for m in messages)
        if chars > max_chars:
            raise invalid("messages", f"total content is {chars} characters, more than {max_chars}")
        if tool_specs:
            tools.check_tools(tool_specs, "auto")
    elif not text:
        raise ServiceError("invalid_argument", "text: set text or messages", field="text")
    else:
        check_text("text", text)
        if len(text) > max_chars:
            raise invalid("text", f"{len(text)} characters, more than {max_chars}")


def _field_message(msg: str) -> str:
    """Engine errors name SamplingParams fields bare; the wire names them under ``sampling.``."""
    name = msg.split(":", 1)[0]
    return f"sampling.{msg}" if name in SAMPLING_FIELDS else msg
