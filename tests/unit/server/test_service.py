"""InferenceService's request path over a scripted engine: admission, the engine phase and what every
ending gives back (rate-limit tokens, the tenant's request id, the engine stream), and the service's
one rule per request field."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

import pytest

from sidecar.config import SidecarConfig
from sidecar.engine.request import QueueFullError, RequestOutput, SamplingParams
from sidecar.server.service import LOADING, Caller, GenerationRequest, InferenceService, ServiceError


class ScriptedEngine:
    """AsyncEngine's surface; ``generate`` emits one output per token of ``script`` (or raises ``refuse``)."""

    def __init__(
        self, script: list[int], max_model_len: int = 32, refuse: Optional[Exception] = None
    ) -> None:
        self.script = script
        self.refuse = refuse
        self.model_info = {"model": "scripted", "max_model_len": max_model_len, "vocab_size": 100}
        self.chat_template = ""
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.closed: list[bool] = []  # per generate call: whether its stream was closed before finishing

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def token_strings(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]

    def special_token_id(self, text: str) -> Optional[int]:
        return None

    def stats(self) -> dict:
        return {}

    def lora_adapters(self) -> dict[str, str]:
        return {}

    async def generate(
        self, prompt: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((prompt, params))
        k = len(self.closed)
        self.closed.append(False)
        if self.refuse is not None:
            raise self.refuse
        done = False
        try:
            for n in range(1, len(self.script) + 1):
                await asyncio.sleep(0)
                done = n == len(self.script)
                yield RequestOutput(
                    kwargs["request_id"],
                    None,
                    prompt,
                    self.script[:n],
                    "x" * n,
                    self.script[n - 1 : n],
                    "x",
                    done,
                    "length" if done else None,
                )
        finally:
            self.closed[k] = not done


class Limiter:
    """Records the service's rate-limit calls; never refuses."""

    def __init__(self) -> None:
        self.tpm = 1000.0
        self.balance = 0

    def acquire(self, key: str, tokens: int) -> Optional[float]:
        self.balance += tokens
        return None

    def charge(self, key: str, tokens: int) -> None:
        self.balance += tokens

    def refund(self, key: str, tokens: int) -> None:
        self.balance -= tokens


def service(engine: Optional[ScriptedEngine]) -> InferenceService:
    svc = InferenceService(SidecarConfig())
    svc.limiter = Limiter()
    if engine is not None:
        svc.attach(engine)  # type: ignore[arg-type]
    return svc


async def collect(svc: InferenceService, req: GenerationRequest, stop_after: Optional[int] = None) -> list:
    events = []
    agen = svc.generate(Caller(), req)
    try:
        async for ev in agen:
            events.append(ev)
            if stop_after is not None and len(events) == stop_after:
                break
    finally:
        await agen.aclose()
    return events


def test_a_finished_request_charges_what_it_generated_and_leaves_the_request_unchanged():
    eng = ScriptedEngine([5, 6, 7])
    svc = service(eng)
    req = GenerationRequest(prompt="hello", params=SamplingParams(max_tokens=10))
    events = asyncio.run(collect(svc, req))
    assert [e.token_ids for e in events] == [[5], [5, 6], [5, 6, 7]] and events[-1].finished
    assert svc.limiter.balance == len("hello") + 3  # max_tokens charged up front, the unused 7 refunded
    assert svc.num_active == 0 and eng.closed == [False]
    assert req.params == SamplingParams(max_tokens=10)


def test_a_defaulted_max_tokens_is_fitted_to_the_context_and_charged_after_the_fact():
    eng = ScriptedEngine([1, 2], max_model_len=8)
    svc = service(eng)
    req = GenerationRequest(prompt="abcde", params=SamplingParams(max_tokens=64), max_tokens_set=False)
    asyncio.run(collect(svc, req))
    assert eng.calls[0][1].max_tokens == 3  # the room left next to the 5-token prompt
    assert req.params.max_tokens == 64
    assert svc.limiter.balance == 5 + 2


def test_a_set_max_tokens_that_cannot_fit_is_refused_before_the_engine():
    eng = ScriptedEngine([1], max_model_len=8)
    with pytest.raises(ServiceError, match=r"^sampling\.max_tokens: 4 tokens plus the prompt's 5"):
        asyncio.run(
            collect(service(eng), GenerationRequest(prompt="abcde", params=SamplingParams(max_tokens=4)))
        )
    assert eng.calls == []


def test_a_client_leaving_mid_stream_closes_the_engine_stream_and_counts_an_abort():
    eng = ScriptedEngine(list(range(1, 9)))
    svc = service(eng)
    events = asyncio.run(collect(svc, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=8)), 2))
    assert len(events) == 2 and eng.closed == [True]
    assert svc.metrics.success.labels(finish_reason="abort")._value.get() == 1
    assert svc.limiter.balance == 2 + 2 and svc.num_active == 0


@pytest.mark.parametrize(
    "refusal, code",
    [
        (QueueFullError("full"), "queue_full"),
        (ValueError("temperature: bad"), "invalid_argument"),
        (RuntimeError("engine is shutting down"), "unavailable"),
    ],
)
def test_engine_refusals_become_service_errors_and_give_everything_back(refusal, code):
    svc = service(ScriptedEngine([1], refuse=refusal))
    with pytest.raises(ServiceError) as err:
        asyncio.run(collect(svc, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=4))))
    assert err.value.code == code
    if code == "invalid_argument":
        assert err.value.message == "sampling.temperature: bad" and err.value.field == "sampling.temperature"
    if code == "queue_full":
        assert err.value.retry_after_s is not None
    assert svc.limiter.balance == 2 and svc.num_active == 0  # prompt charged, max_tokens refunded
    assert svc.metrics.success.labels(finish_reason="abort")._value.get() == 0  # never held: no abort


def test_embedding_model_rule_is_the_same_for_every_transport():
    svc = service(ScriptedEngine([1]))
    svc.check_embedding_model(None)
    for name in (svc.cfg.cache.embedding_model, svc.model_name):
        svc.check_embedding_model(name)
    with pytest.raises(ServiceError) as err:
        svc.check_embedding_model("nope")
    assert err.value.code == "not_found" and err.value.field == "model"


def test_before_the_model_loads_every_call_says_loading():
    svc = service(None)
    with pytest.raises(ServiceError, match=f"^{LOADING}$"):
        svc.check_loaded()
    with pytest.raises(ServiceError, match=f"^{LOADING}$"):
        asyncio.run(collect(svc, GenerationRequest(prompt="hi")))
