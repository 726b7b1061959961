"""8-bit HF checkpoints by their quantization_config (hf8bit.py): compressed-tensors W8A8 and FP8 written
by compressed-tensors' own compressors, and the fp8 method's layout, each greedy float32 equal to HF
transformers on the same directory token for token. FP8 runs weight-only on CPU, so HF's dequantized model
is the reference as it is; W8A8 quantizes activations per token, so its reference is HF's dequantized model
with compressed-tensors' own dynamic quantize-dequantize on each quantized Linear's input (the product
differs from ours only in float rounding: int32 sums scaled afterwards against float32 sums of dequantized
values)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model import fp8, hf8bit
from sidecar.model.linear import Linear
from sidecar.model.loader import load_model
from sidecar.model.w8a8 import W8A8Linear
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.hf8bit_checkpoints import (
    SMALL,
    WHOLE,
    ct_checkpoint,
    fp8_method_checkpoint,
    hf_model,
)
from tests.unit.engine.test_engine_vs_hf import hf_generate

MAX_NEW = 8
PROMPTS = [[5 + (11 * i + 7 * j) % 700 for j in range(n)] for i, n in enumerate([3, 12, 26])]
CASES = {  # name: (builder, the kind of format); whole 128x128 blocks: fp8-method, partial: fp8-block-partial
    "w8a8-llama": (lambda o, t: ct_checkpoint("llama", "W8A8", "int-quantized", o, t, SMALL), "w8a8"),
    "w8a8-qwen2": (lambda o, t: ct_checkpoint("qwen2", "W8A8", "int-quantized", o, t, SMALL), "w8a8"),
    "fp8-channel-qwen2": (
        lambda o, t: ct_checkpoint("qwen2", "FP8_DYNAMIC", "float-quantized", o, t, SMALL),
        "fp8",
    ),
    "fp8-block-partial": (
        lambda o, t: ct_checkpoint("llama", "FP8_BLOCK", "float-quantized", o, t, SMALL),
        "fp8",
    ),
    "fp8-method": (lambda o, t: fp8_method_checkpoint(o, t, WHOLE), "fp8"),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("hf8bit")
    return {name: build(root / name, demo_dir) for name, (build, _) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf_on_the_same_directory(dirs, name):
    kind = CASES[name][1]
    ref = hf_generate(hf_model(dirs[name], activation_quant=kind == "w8a8"), PROMPTS, MAX_NEW)
    assert_not_degenerate(ref)
    llm = LLM(
        model=str(dirs[name]),
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        quantize_lm_head="none",  # the tool's float head as it is (by default int8, as our own int8)
    )
    loaded = llm.engine.loaded
    expected = "fp8" if name == "fp8-method" else f"compressed-tensors-{kind}"
    assert loaded.quantization == expected
    layer = loaded.model.layers[0]
    assert isinstance(layer.mlp.down_proj, W8A8Linear if kind == "w8a8" else Linear)
    assert type(loaded.model.lm_head) is Linear  # ignored / not converted: full precision
    assert [
        o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    ] == ref


def test_w8a8_is_not_the_dequantized_model(dirs):
    """The activation quantization matters: HF without it gives other logits (so the W8A8 test above could not
    pass on a weight-only path)."""
    plain, quant = hf_model(dirs["w8a8-llama"]), hf_model(dirs["w8a8-llama"], activation_quant=True)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        a, b = plain(ids).logits, quant(ids).logits
    assert (a - b).abs().max() > 1e-3
    cfg = EngineConfig(model=str(dirs["w8a8-llama"]), dtype="float32")
    ours = load_model(cfg).model
    hf_layer = quant.model.layers[1].mlp.down_proj
    x = (
        torch.randn(1, 37, hf_layer.in_features) * 2
    )  # [batch, tokens, features]: compressed-tensors' token axis
    with torch.no_grad():
        torch.testing.assert_close(ours.layers[1].mlp.down_proj(x), hf_layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fp8-channel-qwen2", "fp8-block-partial", "fp8-method"])
def test_fp8_weights_equal_the_tools_dequantized_weights(dirs, name):
    hf = hf_model(dirs[name])
    ours = load_model(EngineConfig(model=str(dirs[name]), dtype="float32"), pack=False).model
    hf_attn, attn = hf.model.layers[1].self_attn, ours.layers[1].self_attn
    qkv = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    assert torch.equal(ours.layers[1].mlp.down_proj.weight, hf.model.layers[1].mlp.down_proj.weight)


def _config(dirs, name):
    return json.loads((dirs[name] / "config.json").read_text())["quantization_config"]


def _set(cfg, path, value):
    cfg = copy.deepcopy(cfg)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[last] = value
    return cfg


MALFORMED = [
    ("w8a8-llama", "config_groups.group_0.weights.num_bits", 4),
    ("w8a8-llama", "config_groups.group_0.weights.strategy", "group"),
    ("w8a8-llama", "config_groups.group_0.weights.symmetric", False),
    ("w8a8-llama", "config_groups.group_0.input_activations.dynamic", "yes"),
    ("w8a8-llama", "config_groups.group_0.input_activations.strategy", "tensor"),
    ("w8a8-llama", "config_groups.group_0.input_activations", None),
    ("w8a8-llama", "config_groups.group_0.targets", "Linear"),
    ("w8a8-llama", "config_groups.group_0.format", "pack-quantized"),
    ("w8a8-llama", "quantization_status", "frozen"),
    ("w8a8-llama", "kv_cache_scheme", {"num_bits": 8}),
    ("fp8-block-partial", "config_groups.group_0.weights.block_structure", [128]),
    ("fp8-block-partial", "config_groups.group_0.weights.type", "int"),
    ("fp8-method", "weight_block_size", [128, 0]),
    ("fp8-method", "activation_scheme", "static"),
    ("fp8-method", "fmt", "e5m2"),
    ("fp8-method", "quant_method", "bitsandbytes"),
]


@pytest.mark.parametrize("name,path,value", MALFORMED)
def test_malformed_config_names_the_field(dirs, name, path, value):
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{path}: ")):
        hf8bit.parse_8bit_config(_set(_config(dirs, name), path, value))


def test_loader_reports_a_malformed_config_and_a_second_quantization(dirs, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dirs["w8a8-llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"quantization_config\.config_groups\.group_0\.weights\.num_bits: 4"
    ):
        load_model(EngineConfig(model=str(bad), dtype="float32"))
    with pytest.raises(ValueError, match="already quantized as 'compressed-tensors-w8a8'"):
        load_model(EngineConfig(model=str(dirs["w8a8-llama"]), dtype="float32", quantization="int8"))


def test_fp8_scaled_mm_selection_and_fallback(monkeypatch, caplog):
    """CPU takes the dequantized path with its reason logged; the scaled-mm module itself (torch's CPU
    _scaled_mm runs it here) passes the self-check, and a failing _scaled_mm is caught and named."""
    monkeypatch.setattr(fp8, "_checked", {})
    with caplog.at_level("INFO", logger="sidecar.model"):
        assert "no FP8 units" in fp8.scaled_mm_check(torch.device("cpu"))
    assert "FP8 weights run dequantized on cpu" in caplog.text
    assert fp8.scaled_mm_self_check(torch.device("cpu")) == ""

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    assert "torch._scaled_mm failed (RuntimeError: no kernel)" in fp8.scaled_mm_self_check(
        torch.device("cpu")
    )


def test_a_scale_grid_that_does_not_fit_names_the_tensor(dirs, tmp_path):
    import shutil

    bad = tmp_path / "grid"
    shutil.copytree(dirs["fp8-method"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]  # the stored grid is of 128x128 blocks
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv: scale grid"
    ):
        load_model(EngineConfig(model=str(bad), dtype="float32"))
