"""The service's side of LoRA: a request's model names its adapter, which reaches the engine and scopes the
semantic cache; unknown names and adapters unloaded after admission are not_found naming ``model``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.engine.request import SamplingParams
from sidecar.server.service import GenerationRequest, ServiceError
from test_service import ScriptedEngine, collect, service


class AdapterEngine(ScriptedEngine):
    def __init__(self, *args: Any, refuse_lora: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loras: list = []
        self.refuse_lora = refuse_lora

    def lora_adapters(self) -> dict[str, str]:
        return {"support": "/adapters/support"}

    async def generate(self, prompt, params, **kwargs):
        self.loras.append(kwargs.get("lora"))
        if self.refuse_lora and kwargs.get("lora"):
            raise LookupError("model: 'support' is neither the base model nor a loaded adapter")
        async for out in super().generate(prompt, params, **kwargs):
            yield out


def test_the_model_name_picks_the_adapter_and_scopes_the_cache():
    eng = AdapterEngine([4, 5])
    svc = service(eng)
    scopes = []
    plan = svc.cache_step.plan
    svc.cache_step.plan = lambda tenant, req, params, model, template_kwargs=None: (
        scopes.append(model) or plan(tenant, req, params, model)
    )
    for model in ("support", None, "scripted"):
        events = asyncio.run(
            collect(svc, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=2), model=model))
        )
        assert events[-1].finished
    assert eng.loras == ["support", None, None]
    assert scopes == ["support", "scripted", "scripted"]
    assert svc.model_info()["lora_adapters"] == {"support": "/adapters/support"}


def test_unknown_models_and_adapters_gone_after_admission_are_not_found_naming_model():
    eng = AdapterEngine([4])
    with pytest.raises(ServiceError) as err:
        asyncio.run(collect(service(eng), GenerationRequest(prompt="hi", model="nope")))
    assert (err.value.code, err.value.field) == ("not_found", "model")
    assert "'nope'" in err.value.message and "'support'" in err.value.message
    assert eng.calls == []
    gone = AdapterEngine([4], refuse_lora=True)
    svc = service(gone)
    with pytest.raises(ServiceError) as err:
        asyncio.run(
            collect(svc, GenerationRequest(prompt="hi", params=SamplingParams(max_tokens=2), model="support"))
        )
    assert (err.value.code, err.value.field) == ("not_found", "model")
    assert svc.num_active == 0
