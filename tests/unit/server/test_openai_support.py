"""A fake ``InferenceService`` for the OpenAI adapter's unit tests (no engine, no model).

Its answers are a pure function of the request, so tests can predict them:
choice text is ``" w<seed>_<j>"`` for j in range(max_tokens) (seed None -> 0).
It records every request it saw and which engine requests are still live, so
tests can check that a call's requests all end, however the call ends.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from sidecar.engine.request import TokenLogprob
from sidecar.server.cache_step import CacheInfo
from sidecar.server.service import Caller, Event, GenerationRequest
from sidecar.server.validation import ServiceError


def expected_text(seed: Optional[int], max_tokens: int) -> str:
    return "".join(f" w{seed or 0}_{j}" for j in range(max_tokens))


class FakeService:
    model_name = "demo"

    def __init__(self, api_key: Optional[str] = None, token_delay_s: float = 0.0) -> None:
        self.serving = True
        self.draining = False
        self.api_key = api_key
        self.token_delay_s = token_delay_s
        self.requests: list[GenerationRequest] = []
        self.live: set[str] = set()  # request ids whose generator has not finished or been closed
        self.closed_early: list[str] = []
        self.fail_before_first: Optional[ServiceError] = None
        self.fail_after_tokens: Optional[tuple[int, ServiceError]] = None
        self.cache_status = "miss"
        self.embed_calls: list[list[str]] = []
        self.max_produced: Optional[int] = None  # cap on tokens per request (fuzzing sends huge max_tokens)
        self.loras: dict[str, str] = {}  # LoRA adapters loaded at run time: name -> path

    def authenticate(self, authorization: Optional[str], peer: str = "") -> Caller:
        if self.api_key is not None and authorization != f"Bearer {self.api_key}":
            raise ServiceError("unauthenticated", "invalid API key")
        return Caller(tenant="t" if self.api_key else "", key_id=None, operator=True)

    async def generate(self, caller: Caller, req: GenerationRequest):
        self.requests.append(req)
        if not self.serving:
            raise ServiceError("unavailable", "draining: the sidecar is shutting down")
        if req.model and req.model != self.model_name:
            raise ServiceError("not_found", f"model: unknown model {req.model!r}", field="model")
        if self.fail_before_first is not None:
            raise self.fail_before_first
        rid = req.request_id
        self.live.add(rid)
        p = req.params
        prompt_tokens = (
            len(req.prompt_token_ids or [])
            or len(req.prompt or "")
            or sum(len(m["content"]) for m in req.messages or [])
        )
        text, ids, finished = "", [], False
        try:
            n_out = p.max_tokens if self.max_produced is None else min(p.max_tokens, self.max_produced)
            for j in range(n_out):
                if self.fail_after_tokens and j == self.fail_after_tokens[0]:
                    raise self.fail_after_tokens[1]
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                else:
                    await asyncio.sleep(0)
                delta = f" w{p.seed or 0}_{j}"
                tid = 1000 + j
                text += delta
                ids.append(tid)
                finished = j == n_out - 1
                lps = None
                if p.logprobs is not None:
                    lps = [TokenLogprob(tid, -0.25, [(tid, -0.25), (7, -1.5)][: p.logprobs])]
                yield Event(
                    request_id=rid,
                    delta_text=delta,
                    new_token_ids=[tid],
                    new_logprobs=lps,
                    finished=finished,
                    finish_reason="length" if finished else None,
                    text=text,
                    token_ids=list(ids),
                    prompt_tokens=prompt_tokens,
                    completion_tokens=len(ids),
                    cached_tokens=2,
                    queue_ms=0.0,
                    ttft_ms=1.0,
                    total_ms=2.0,
                    cache=CacheInfo(status=self.cache_status),
                )
        finally:
            self.live.discard(rid)
            if not finished:
                self.closed_early.append(rid)

    async def embed(
        self, caller: Caller, inputs: list[str], model: Optional[str] = None
    ) -> tuple[list[list[float]], int]:
        if not self.serving:
            raise ServiceError("unavailable", "loading")
        if model and model not in (self.model_info()["embedding_model"], self.model_name):
            raise ServiceError("not_found", f"model: unknown embedding model {model!r}", field="model")
        for i, t in enumerate(inputs):
            if not t.strip():
                raise ServiceError(
                    "invalid_argument", f"inputs[{i}]: must be a non-empty string", field="inputs"
                )
        self.embed_calls.append(inputs)
        return [[float(len(t)), 0.5, -1.0] for t in inputs], sum(len(t) for t in inputs)

    def require_operator(self, caller: Caller, action: str) -> None:
        if not caller.operator:
            raise ServiceError("permission_denied", f"permission denied: {action} is an operator action")

    async def load_lora(self, caller: Caller, name: str, path: str, tenant: Optional[str] = None) -> None:
        if name in self.loras or name == self.model_name:
            raise ServiceError(
                "invalid_argument", f"lora_name: adapter {name!r} is already loaded", field="lora_name"
            )
        if not path.startswith("/"):
            raise ServiceError("invalid_argument", f"lora_path: {path}: not a directory", field="lora_path")
        self.loras[name] = path

    async def unload_lora(self, caller: Caller, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise ServiceError("not_found", f"lora_name: adapter {name!r} is not loaded", field="lora_name")

    def token_strings(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    def model_info(self, caller: Optional[Caller] = None) -> dict:
        return {
            "model": "demo",
            "max_model_len": 40,
            "embedding_model": "all-MiniLM-L6-v2",
            "lora_adapters": dict(self.loras),
        }

    def render_metrics(self) -> tuple[bytes, str]:
        return b"sidecar_kv_cache_free_blocks 7.0\n", "text/plain; version=0.0.4; charset=utf-8"


async def asgi_call(
    app: Any,
    method: str,
    path: str,
    body: bytes,
    disconnect_after_chunks: Optional[int] = None,
    headers: Optional[list[tuple[bytes, bytes]]] = None,
) -> dict[str, Any]:
    """Drive the app through raw ASGI so a test controls when the client disconnects.

    ``disconnect_after_chunks=k`` makes ``receive`` report ``http.disconnect``
    once k body chunks were sent (0: right after the request body).
    """
    sent: list[dict] = []
    body_sent = False
    chunk_count = asyncio.Event()

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after_chunks is None:
            await asyncio.Event().wait()  # never: the app ends the exchange
        while sum(1 for m in sent if m["type"] == "http.response.body") < disconnect_after_chunks:
            chunk_count.clear()
            await chunk_count.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        chunk_count.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "server": ("test", 80),
        "client": ("test", 1),
        "headers": [(b"content-type", b"application/json")] + (headers or []),
    }
    await app(scope, receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    return {
        "status": start["status"] if start else None,
        "body": b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"),
    }
