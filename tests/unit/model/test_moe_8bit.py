"""8-bit mixture-of-experts checkpoints (hf8bit.py): Mixtral and Qwen3-MoE whose experts are compressed-tensors
W8A8 (dynamic per-token and static per-tensor activations) or FP8 (per channel, 128x128 blocks) written by
compressed-tensors' own compressors, and the ``fp8`` method's layout (moe8bit_checkpoints.py). Greedy float32
equals HF transformers token for token with a tight pool (preemption) and a small token budget (chunked
prefill); the experts run as the dense formats' layers (W8A8 as ``W8A8Linear`` over its int8 codes, FP8 on the
CPU as our ``Linear`` over the exact dequantized weight), the routers in full precision; unsupported layouts
are refused naming the field."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.linear import Linear
from sidecar.model.loader import load_model
from sidecar.model.moe import SparseMoE
from sidecar.model.w8a8 import W8A8Linear
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.moe8bit_checkpoints import (
    ct_moe_checkpoint,
    decompressed_copy,
    fp8_method_moe_checkpoint,
    hf_moe_reference,
)

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 40, 14, 22, 16])]
# Qwen3-MoE's W8A8 case with smaller weights and routers further from ties. Its greedy tokens still move with
# the rounding of single activation codes (HF against itself with its embeddings moved by 1e-6 differs by
# tenths of a logit), so on another CPU's float kernels a token comparison would test float rounding: this case
# is compared block by block (``test_expert_activations_are_quantized_per_token``), not token by token.
CALM = dict(initializer_range=0.15, router_scale=4.0)
BLOCK_ONLY = ("w8a8-qwen3_moe",)
# name: (kind, builder(out, tokenizer_dir), whether HF reads the directory itself, the format's name, W8A8)
CASES = {
    "w8a8-mixtral": (
        "mixtral",
        lambda o, t: ct_moe_checkpoint("mixtral", "W8A8", "int-quantized", o, t),
        False,
        "compressed-tensors-w8a8",
        True,
    ),
    "w8a8-qwen3_moe": (
        "qwen3_moe",
        lambda o, t: ct_moe_checkpoint("qwen3_moe", "W8A8", "int-quantized", o, t, **CALM),
        False,
        "compressed-tensors-w8a8",
        True,
    ),
    "w8a8-static-mixtral": (
        "mixtral",
        lambda o, t: ct_moe_checkpoint("mixtral", "W8A8", "int-quantized", o, t, calibration=PROMPTS[:3]),
        False,
        "compressed-tensors-w8a8",
        True,
    ),
    "fp8-channel-qwen3_moe": (
        "qwen3_moe",
        lambda o, t: ct_moe_checkpoint("qwen3_moe", "FP8_DYNAMIC", "float-quantized", o, t),
        True,
        "compressed-tensors-fp8",
        False,
    ),
    "fp8-block-partial-mixtral": (  # experts 160 wide: two row blocks, the second partial
        "mixtral",
        lambda o, t: ct_moe_checkpoint(
            "mixtral", "FP8_BLOCK", "float-quantized", o, t, intermediate_size=160
        ),
        False,
        "compressed-tensors-fp8",
        False,
    ),
    "fp8-method-qwen3_moe": (  # whole 128x128 blocks, as transformers' fp8 loader reads them
        "qwen3_moe",
        lambda o, t: fp8_method_moe_checkpoint("qwen3_moe", o, t, hidden_size=128, moe_intermediate_size=256),
        True,
        "fp8",
        False,
    ),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("moe8bit")
    return {name: case[1](root / name, demo_dir) for name, case in CASES.items()}


def _reference(dirs, name, activation_quant=None):
    kind, _, same_dir, _, w8a8 = CASES[name]
    d, dense = dirs[name], None
    if not same_dir:  # the copy compressed-tensors' decompressor writes (moe8bit_checkpoints.py)
        dense = d.with_name(d.name + "-deq")
        if not dense.exists():
            decompressed_copy(d, dense)
    return hf_moe_reference(d, kind, dense, w8a8 if activation_quant is None else activation_quant)


@pytest.mark.parametrize("name", [n for n in CASES if n not in BLOCK_ONLY])
def test_greedy_matches_hf_with_preemption_and_chunked_prefill(dirs, name):
    kind, _, _, label, w8a8 = CASES[name]
    ref = hf_generate(_reference(dirs, name), PROMPTS, MAX_NEW)
    assert_not_degenerate(ref)
    llm = LLM(
        model=str(dirs[name]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,
        max_num_batched_tokens=16,
        quantize_lm_head="none",  # the tool's float head as it is
    )
    loaded = llm.engine.loaded
    assert loaded.quantization == label and llm.engine.model_info["quantization"] == label
    blocks = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert blocks
    cls = W8A8Linear if w8a8 else Linear
    for moe in blocks:
        assert type(moe.gate) is Linear  # the router as the tool left it
        assert all(isinstance(m, cls) for e in moe.experts for m in (e.gate_up_proj, e.down_proj))
    if w8a8:  # the codes stay 8-bit: no float tensor of the weight's size is held
        lin = blocks[0].experts[0].down_proj
        size = lin.in_features * lin.out_features
        assert not any(b.is_floating_point() and b.numel() >= size for b in lin.buffers())
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize("name", ["w8a8-mixtral", "w8a8-qwen3_moe"])
def test_expert_activations_are_quantized_per_token(dirs, name):
    """Our sparse block equals HF's with compressed-tensors' per-token quantizer on each expert product, and
    HF's weight-only block (the dequantized weights alone) is further off than float rounding: a weight-only
    expert path would fail the greedy test above."""
    quant, plain = _reference(dirs, name), _reference(dirs, name, activation_quant=False)
    ours = load_model(EngineConfig(model=str(dirs[name]), dtype="float32")).model
    x = torch.randn(1, 9, ours.args.hidden_size, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad():
        got = ours.layers[1].mlp(x[0])
        want = quant.model.layers[1].mlp(x)[0]
        weight_only = plain.model.layers[1].mlp(x)[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * scale
    assert float((weight_only - want).abs().max()) > 1e-2 * scale


def test_fp8_experts_are_the_dequantized_weights(dirs):
    """On the CPU each FP8 expert's weight is the format's dequantized value exactly (e4m3 times its block
    scale), against transformers' own dequantization of the same directory."""
    name = "fp8-method-qwen3_moe"
    hf = _reference(dirs, name)
    ours = load_model(EngineConfig(model=str(dirs[name]), dtype="float32"), pack=False).model
    experts, hf_experts = ours.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    for e in (0, 5):
        assert torch.equal(experts[e].gate_up_proj.weight, hf_experts.gate_up_proj[e])
        assert torch.equal(experts[e].down_proj.weight, hf_experts.down_proj[e])


def test_the_format_is_reported_by_models_grpc_and_the_start_line(dirs):
    from fastapi.testclient import TestClient

    from sidecar.server.app import describe
    from sidecar.server.openai.api import create_app
    from tests.unit.server.test_openai_support import FakeService

    for name in ("w8a8-qwen3_moe", "fp8-method-qwen3_moe"):
        info = LLM(model=str(dirs[name]), dtype="float32", num_kv_blocks=32).engine.model_info
        label = CASES[name][3]
        assert f"quantization={label}" in describe(info)
        svc = FakeService()
        base = svc.model_info
        svc.model_info = lambda *caller, base=base, info=info: dict(
            base(*caller), quantization=info["quantization"]
        )
        model = TestClient(create_app(svc)).get("/v1/models").json()["data"][0]
        assert model["quantization"] == label
        assert _grpc_model_info(info).quantization == label


def _grpc_model_info(info: dict):
    """GetModelInfo of a service whose engine reports ``info``'s facts."""
    import asyncio

    import grpc

    from sidecar.config import SidecarConfig
    from sidecar.server.grpc.servicer import Health, build_server
    from sidecar.server.service import InferenceService
    from sidecar.v1 import sidecar_pb2 as pb
    from sidecar.v1 import sidecar_pb2_grpc as pbg
    from tests.unit.server.test_service import Limiter, ScriptedEngine

    engine = ScriptedEngine([4, 5])
    engine.model_info.update(quantization=info["quantization"])
    svc = InferenceService(SidecarConfig())
    svc.limiter = Limiter()
    svc.attach(engine)  # type: ignore[arg-type]

    async def scenario():
        server = build_server(svc, Health(), 1 << 20, 16)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await pbg.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest())
        finally:
            await server.stop(None)

    return asyncio.run(scenario())


def _copy(dirs, name, tmp_path):
    out = tmp_path / name
    shutil.copytree(dirs[name], out)
    return out


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_malformed_expert_config_names_the_field(dirs, tmp_path):
    bad = _copy(dirs, "w8a8-mixtral", tmp_path)

    def edit(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "group"

    _edit_config(bad, edit)
    with pytest.raises(
        ValueError,
        match=re.escape("quantization_config.config_groups.group_0.input_activations.strategy: 'group'"),
    ):
        load_model(EngineConfig(model=str(bad), dtype="float32"))


def test_a_quantized_router_is_refused_naming_the_ignore_list(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _copy(dirs, "w8a8-mixtral", tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    router = "model.layers.0.block_sparse_moe.gate"
    w = tensors[f"{router}.weight"]
    scale = w.abs().amax(1, keepdim=True) / 127.0
    tensors[f"{router}.weight"] = torch.round(w / scale).to(torch.int8)
    tensors[f"{router}.weight_scale"] = scale
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(
        ValueError, match=re.escape(f"quantization_config.ignore: the router {router} is quantized")
    ):
        load_model(EngineConfig(model=str(bad), dtype="float32"))


def test_experts_with_biases_are_refused_naming_the_config(dirs, tmp_path, demo_dir):
    out = build_family_checkpoint("gpt_oss", tmp_path / "gpt_oss", demo_dir)
    qc = json.loads((dirs["w8a8-mixtral"] / "config.json").read_text())["quantization_config"]
    _edit_config(out, lambda cfg: cfg.__setitem__("quantization_config", qc))
    with pytest.raises(ValueError, match="quantization_config: compressed-tensors-w8a8 experts of GptOss"):
        load_model(EngineConfig(model=str(out), dtype="float32"))
