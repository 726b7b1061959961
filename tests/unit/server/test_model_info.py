"""What the sidecar says about the served model: /v1/models entries and the start line carry the
architecture and what it runs with (dtype, quantization, KV dtype, device, fast paths, formats)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from sidecar.server.app import describe
from sidecar.server.openai.api import create_app
from test_openai_support import FakeService


def test_the_start_line_names_architecture_precision_kv_device_and_formats(demo_dir):
    from sidecar import LLM

    info = dict(LLM(model=str(demo_dir), dtype="float32").engine.model_info, reasoning=True)
    info["tool_call_format"] = "hermes"
    line = describe(info)
    assert line.startswith("arch=Qwen2ForCausalLM, dtype=float32, quantization=none, kv=float32, device=cpu")
    assert "fast paths=none" in line and "cpu decode replay=" in line
    assert line.endswith("tool calls=hermes, reasoning")


def test_models_list_the_architecture_and_runtime():
    svc = FakeService()
    facts = {
        "architecture": "Qwen3ForCausalLM",
        "dtype": "bfloat16",
        "quantization": "int8",
        "device": "cuda:0",
        "reasoning": True,
        "tool_call_format": "hermes",
        "kv_cache_dtype": "int8",
        "fast_paths": ["attention", "cuda_graphs"],
    }
    base = svc.model_info
    svc.model_info = lambda *caller: dict(base(*caller), **facts)
    m = TestClient(create_app(svc)).get("/v1/models").json()["data"][0]
    assert {k: m[k] for k in facts} == facts
