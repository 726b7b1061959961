"""The service's cache step: plan, look up and store a request in the semantic cache.

The server must keep working with the cache disabled even where the cache's
dependencies (FAISS, the embedder) are missing, so the only cache module
imported at module level is the dependency-free ``sidecar.cache.policy``; the
rest is imported when a cache exists. A cache failure never fails a request: a
lookup error is a miss, a store error is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from sidecar.cache.policy import CachePolicy, cache_policy
from sidecar.config import CacheConfig
from sidecar.engine.request import SamplingParams
from sidecar.server.coalesce import Coalescer, flight_key
from sidecar.server.tools import tools_key
from sidecar.server.validation import ServiceError

log = logging.getLogger("sidecar.cache_step")


@dataclass
class CacheInfo:
    status: str = "bypass"  # miss | hit_exact | hit_semantic | bypass
    similarity: float = 0.0
    matched_query: str = ""
    bypass_reason: str = ""
    coalesced: bool = False  # answered by following an identical request's generation


@dataclass
class Plan:
    policy: Any
    scope: Any
    info: CacheInfo
    lookup_ms: float = 0.0
    vector: Optional[asyncio.Task] = None  # the query's embedding, started when the engine is called
    participant: Any = None  # the coalescing participant, when the request joined a flight


# Sampling fields that change the answer; logprobs/skip_special_tokens do not change the text.
_SETTINGS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)


def settings_key(params: Any, tools: str = "", template_kwargs: Optional[dict] = None) -> str:
    """What besides the conversation decides the answer. The output constraint, the tool setup and the
    chat-template variables (thinking on or off) are part of it, so a tool-call answer is never served to
    a request without the same tools, nor an answer without reasoning to one that asked for it."""
    d = {k: getattr(params, k) for k in _SETTINGS}
    structured = getattr(params, "structured", None)
    if structured is not None:  # absent for free text, so keys of free-text requests are unchanged
        d["structured"] = structured.key()
    if getattr(params, "beam_width", None) is not None:  # absent unless beam search, as above
        d["beam_width"], d["length_penalty"] = params.beam_width, params.length_penalty
    if getattr(params, "kv_budget", None) is not None or getattr(params, "kv_eviction", None) is not None:
        d["kv_budget"], d["kv_eviction"] = params.kv_budget, params.kv_eviction  # bounded KV changes the text
    if tools:
        d["tools"] = tools
    if template_kwargs:  # absent when none, so keys of other requests are unchanged
        d["template"] = template_kwargs
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


class CacheStep:
    """The service's view of the semantic cache; ``cache`` is None when it is disabled."""

    def __init__(self, cache: Any, embedder: Any, cfg: CacheConfig) -> None:
        self.cache = cache
        self.embedder = embedder
        self.cfg = cfg
        self._embedder_lock = asyncio.Lock()
        self.coalescer = Coalescer()

    def stats(self) -> dict:
        if self.cache is None:
            return {}
        return dict(self.cache.stats(), coalesced=self.coalescer.coalesced)

    def embedding_model_name(self) -> str:
        return getattr(self.embedder, "model_name", "") or (self.cfg.embedding_model if self.cache else "")

    def embedding_dim(self) -> int:
        return int(getattr(self.embedder, "dim", 0) or 0)

    def plan(
        self,
        tenant: str,
        req: Any,
        params: SamplingParams,
        model: str,
        template_kwargs: Optional[dict] = None,
    ) -> Plan:
        """Decide lookup/store for a request and build its cache scope; ``params`` are the ones the engine
        would run (tool grammar and fitted max_tokens included) and ``template_kwargs`` the chat-template
        variables it was rendered with, so they key the answer."""
        # The request was validated before this step, so cache_policy's own checks cannot fail here.
        policy = cache_policy(
            req.cache_control,
            params.temperature,
            req.cache_sampled,
            self.cache is not None,
            self.cfg.allow_sampled,
        )
        reason = policy.bypass_reason
        # Token-id prompts have no question text; logprobs are not stored with answers.
        if (policy.lookup or policy.store) and req.prompt_token_ids:
            policy, reason = CachePolicy(False, False, "token_ids"), "token_ids"
        elif (policy.lookup or policy.store) and params.logprobs is not None:
            policy, reason = CachePolicy(False, False, "logprobs"), "logprobs"
        if not policy.lookup:
            info = CacheInfo(status="bypass", bypass_reason=reason or "")
            if self.cache is not None and reason:
                self.cache.record_bypass(reason)
        else:
            info = CacheInfo(status="miss")
        scope = None
        if self.cache is not None and (policy.lookup or policy.store):
            from sidecar.cache.semantic import CacheScope

            scope_tenant = tenant + ("\x1f" + req.cache_salt if req.cache_salt else "")
            if req.messages:
                # Tool calls and tool results are part of the conversation; plain messages keep their key.
                context = json.dumps(
                    [
                        [m["role"], m["content"]]
                        + (
                            [m.get("tool_calls"), m.get("tool_call_id")]
                            if m.get("tool_calls") or m["role"] == "tool"
                            else []
                        )
                        for m in req.messages[:-1]
                    ],
                    ensure_ascii=False,
                    separators=(",", ":"),
                )
                query = req.messages[-1]["content"]
            else:
                context, query = "", req.prompt
            tools = tools_key(
                getattr(req, "tools", None),
                getattr(req, "tool_choice", "none"),
                getattr(req, "parallel_tool_calls", True),
            )
            scope = CacheScope(
                tenant=scope_tenant,
                model=model,
                settings=settings_key(params, tools, template_kwargs),
                context=context,
                query=query,
            )
        return Plan(policy=policy, scope=scope, info=info)

    async def lookup(self, plan: Plan) -> Any:
        t0 = time.perf_counter()
        try:
            hit = await self.cache.lookup(plan.scope)
        except Exception:
            log.warning("semantic cache lookup failed; treating as a miss", exc_info=True)
            hit = None
        plan.lookup_ms = (time.perf_counter() - t0) * 1000.0
        return hit

    def engine_stream(
        self,
        plan: Plan,
        prompt: list[int],
        model: Optional[str],
        deadline: Optional[float],
        start: Callable[[], AsyncIterator[Any]],
    ) -> AsyncIterator[Any]:
        """The output stream for a request the cache did not answer. ``start()`` opens its own engine
        stream. A request the cache would look up and store joins identical in-flight requests
        (``sidecar.server.coalesce``) and starts the engine only if it leads. A request whose answer
        will be stored starts embedding its query now, so the vector is ready when the answer is."""
        if self.cache is None or plan.scope is None:
            return start()
        stream: Any = None
        if plan.policy.lookup and plan.policy.store:  # skip / refresh: a generation of its own
            from sidecar.cache.semantic import scope_key

            def followed() -> None:
                plan.info.coalesced = True

            key = flight_key(scope_key(plan.scope) + "\x1f" + plan.scope.query, prompt, model)
            stream = plan.participant = self.coalescer.stream(key, start, deadline, followed)
        if plan.policy.store and not plan.info.coalesced:  # a follower stores nothing, so needs no vector
            plan.vector = asyncio.get_running_loop().create_task(self.cache.query_vector(plan.scope))
            plan.vector.add_done_callback(_quiet)
        return stream if stream is not None else start()

    async def remember(self, plan: Plan, out: Any) -> None:
        """Put a finished answer into the cache's in-memory tiers before it is returned, so the next
        identical or similar request hits; persistence follows behind the response. A follower of a
        coalesced generation stores nothing (its leader does). Never raises."""
        if plan.participant is not None and not plan.participant.leading:
            return
        try:
            vec = await plan.vector if plan.vector is not None else await self.cache.query_vector(plan.scope)
            entry = await asyncio.to_thread(
                self.cache.insert,
                plan.scope,
                out.text,
                list(out.token_ids),
                out.finish_reason,
                len(out.prompt_token_ids),
                len(out.token_ids),
                vec,
            )
        except Exception:
            log.warning("semantic cache store failed", exc_info=True)
            return
        if entry is not None:
            fut = self.cache.persist(entry)
            fut.add_done_callback(_persisted)

    async def get_embedder(self) -> Any:
        """The shared embedder; built on first use when the cache is off."""
        async with self._embedder_lock:
            if self.embedder is None:
                try:
                    from sidecar.cache.embedder import Embedder
                except ImportError as exc:
                    raise ServiceError("unavailable", f"embeddings unavailable: {exc}") from None
                self.embedder = await asyncio.to_thread(Embedder, self.cfg.embedding_model)
            return self.embedder

    async def close(self) -> None:
        if self.cache is not None:  # waits (off the loop) for the writes still queued behind responses
            await asyncio.to_thread(self.cache.close)
        if self.embedder is not None and hasattr(self.embedder, "close"):
            self.embedder.close()


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failed embedding surfaces in remember(), not as an unhandled error


def _persisted(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning(
            "semantic cache: persisting an answer failed (it stays served from memory): %s", fut.exception()
        )
