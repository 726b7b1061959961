"""compressed-tensors W8A8 with static per-tensor input scales (``input_activations.dynamic: false``),
written by compressed-tensors' own compressor: greedy float32 equal to HF transformers on the same directory
with the tool's fake quantization of each Linear's input at its stored scale; refusals name the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.loader import load_model
from sidecar.model.w8a8 import W8A8Linear
from tests.unit.engine.test_engine_vs_hf import hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.hf8bit_checkpoints import (
    ct_static_w8a8_checkpoint,
    hf_model,
    static_w8a8_reference,
)

PROMPTS = [[5 + (11 * i + 7 * j) % 700 for j in range(n)] for i, n in enumerate([3, 12, 26])]
MAX_NEW = 8


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory, demo_dir):
    return ct_static_w8a8_checkpoint("qwen2", tmp_path_factory.mktemp("w8a8s") / "q", demo_dir, PROMPTS)


def test_static_w8a8_greedy_equals_hf_with_the_tools_fake_quantization(static_dir):
    hf = static_w8a8_reference(static_dir)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():  # the reference really quantizes its activations
        assert not torch.equal(hf(ids).logits, hf_model(static_dir)(ids).logits)
    ref = hf_generate(hf, PROMPTS, MAX_NEW)
    assert_not_degenerate(ref)
    llm = LLM(model=str(static_dir), dtype="float32", num_kv_blocks=64, quantize_lm_head="none")
    loaded = llm.engine.loaded
    assert loaded.quantization == "compressed-tensors-w8a8"
    attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    # q, k and v were calibrated to different scales: three parts; gate and up share theirs: one
    assert isinstance(attn.qkv_proj, W8A8Linear) and attn.qkv_proj.input_scales.numel() == 3
    assert isinstance(mlp.gate_up_proj, W8A8Linear) and mlp.gate_up_proj.input_scales.numel() == 1
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == ref


@pytest.mark.parametrize(
    "field,value",
    [("strategy", "token"), ("symmetric", False), ("strategy", "channel")],
)
def test_static_activation_fields_that_do_not_fit_are_named(static_dir, tmp_path, field, value):
    bad = tmp_path / "bad"
    shutil.copytree(static_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"][field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config_groups\.group_0\.input_activations\.{field}: "):
        load_model(EngineConfig(model=str(bad), dtype="float32"))
