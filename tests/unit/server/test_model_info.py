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
    # a dense model runs all it holds: one count
    assert info["total_parameters"] == info["active_parameters"] > 0
    assert f"device=cpu, params={info['total_parameters'] / 1e6:.1f}M, fast paths" in line


def test_the_start_line_counts_a_mixture_of_experts_total_and_active_parameters():
    line = describe(
        {
            "architecture": "Qwen3MoeForCausalLM",
            "total_parameters": 30_532_122_624,
            "active_parameters": 3_338_942_464,
        }
    )
    assert "params=30.5B (3.3B active)" in line


def test_the_start_line_names_the_heads_precision_under_quantized_weights():
    line = describe({"architecture": "Qwen2ForCausalLM", "quantization": "gptq-int4", "lm_head": "int8"})
    assert "quantization=gptq-int4 (lm_head int8), kv=" in line
    assert "lm_head" not in describe({"quantization": "none", "lm_head": "float32"})


def test_models_list_the_architecture_and_runtime():
    svc = FakeService()
    facts = {
        "architecture": "Qwen3ForCausalLM",
        "dtype": "bfloat16",
        "quantization": "int8",
        "lm_head": "int8",
        "device": "cuda:0",
        "reasoning": True,
        "tool_call_format": "hermes",
        "kv_cache_dtype": "int8",
        "fast_paths": ["attention", "cuda_graphs"],
        "total_parameters": 30_532_122_624,
        "active_parameters": 3_338_942_464,
        "cache_groups": [
            {"kind": "attention", "layers": 16, "bytes": 1 << 30, "tokens": 65536},
            {
                "kind": "linear_attention",
                "layers": 48,
                "bytes": 1 << 28,
                "slots": 8,
                "bytes_per_sequence": 1 << 25,
            },
        ],
    }
    base = svc.model_info
    svc.model_info = lambda *caller: dict(base(*caller), **facts)
    m = TestClient(create_app(svc)).get("/v1/models").json()["data"][0]
    assert {k: m[k] for k in facts} == facts


def test_grpc_model_info_carries_total_and_active_parameters():
    import asyncio

    import grpc

    from sidecar.config import SidecarConfig
    from sidecar.server.grpc.servicer import Health, build_server
    from sidecar.server.service import InferenceService
    from sidecar.v1 import sidecar_pb2 as pb
    from sidecar.v1 import sidecar_pb2_grpc as pbg
    from test_service import Limiter, ScriptedEngine

    engine = ScriptedEngine([4, 5])
    engine.model_info.update(total_parameters=30_532_122_624, active_parameters=3_338_942_464)
    svc = InferenceService(SidecarConfig())
    svc.limiter = Limiter()
    svc.attach(engine)  # type: ignore[arg-type]

    async def scenario() -> pb.ModelInfo:
        server = build_server(svc, Health(), 1 << 20, 16)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await pbg.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest())
        finally:
            await server.stop(None)

    info = asyncio.run(scenario())
    assert (info.total_parameters, info.active_parameters) == (30_532_122_624, 3_338_942_464)
