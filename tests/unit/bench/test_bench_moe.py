"""The MoE bench on a tiny Qwen3-MoE checkpoint: a one-row step's decoder layers read exactly their attention,
norms, router and the k picked experts -- in bf16 two bytes per active parameter, far below the total -- and
a quantized model reads fewer bytes; the benchmark shape builds a loadable Qwen3-MoE checkpoint; the gpt-oss shape
an MXFP4 checkpoint whose experts stay as codes (4.25 bits a weight) against the same experts dequantized."""

from __future__ import annotations

import argparse
import json

import pytest

from sidecar.bench import moe as bench_moe
from tests.unit.model.family_checkpoints import build_family_checkpoint

ARGS = argparse.Namespace(tokens=4, count_steps=3, group_size=32)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, demo_dir):
    return build_family_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bench-moe") / "qwen3_moe", demo_dir)


def test_a_token_reads_only_its_experts(moe_dir):
    bf16 = bench_moe._measure(str(moe_dir), "bf16", ARGS)
    cfg = json.loads((moe_dir / "config.json").read_text())
    h, width, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    idle = 2 * (cfg["num_local_experts"] - k) * 3 * h * width  # two sparse layers' unpicked experts
    assert bf16["layer_total_params"] - bf16["layer_active_params"] == idle
    # bf16 weights held once each (the tile layout alone on AVX2, AMX's alone where it runs)
    assert bf16["layer_bytes_per_token"] == 2 * bf16["layer_active_params"]
    assert bf16["layer_bytes_per_active_param"] == 2.0
    assert bf16["b1_decode_tok_s"] > 0 and bf16["peak_rss_mib"] > 0
    int8 = bench_moe._measure(str(moe_dir), "int8", ARGS)
    assert int8["active_params"] == bf16["active_params"]
    assert int8["layer_bytes_per_token"] < 0.75 * bf16["layer_bytes_per_token"]
    # the grouped int8 kernel's reads count too: about a byte a picked weight, plus the row scales
    assert 1.0 < int8["layer_bytes_per_active_param"] < 1.25


def test_the_moe_benchmark_shape_builds_a_qwen3_moe_checkpoint(tmp_path, monkeypatch):
    from sidecar.bench import models
    from sidecar.model.args import ModelArgs

    tiny = dict(
        models.QWEN3_30B_A3B_12L,
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=1024,  # at least the demo tokenizer's
    )
    monkeypatch.setitem(models.SHAPES, "tiny-moe", tiny)
    out = models.random_checkpoint("tiny-moe", out=tmp_path / "ckpt")
    args = ModelArgs.from_hf_config(json.loads((out / "config.json").read_text()))
    assert (args.architecture, args.num_experts, args.experts_per_token) == ("Qwen3MoeForCausalLM", 4, 2)
    assert args.expert_intermediate_size == 32 and args.norm_topk_prob and not args.dense_layers
    from sidecar import LLM, SamplingParams

    out_tokens = LLM(model=str(out), dtype="bfloat16").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert len(out_tokens[0].token_ids) == 3


def test_the_gpt_oss_shape_keeps_its_mxfp4_experts_as_codes(tmp_path, monkeypatch):
    from sidecar.bench import models

    tiny = dict(
        models.GPT_OSS_20B,
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        vocab_size=1024,  # at least the demo tokenizer's
    )
    monkeypatch.setitem(models.SHAPES, "tiny-gpt-oss", tiny)
    out = str(models.random_checkpoint("tiny-gpt-oss", out=tmp_path / "ckpt"))
    codes, dense = (bench_moe._measure(out, p, ARGS) for p in ("mxfp4", "dequant"))
    weights = 2 * 4 * 3 * 64 * 64  # layers x experts x (gate, up, down) x hidden x width
    biases = 2 * 4 * (2 * 64 + 64) * 2  # bf16
    assert codes["expert_mib"] * 2**20 == weights // 2 + weights // 32 + biases
    assert dense["expert_mib"] * 2**20 == weights * 2 + biases
    assert codes["active_params"] == dense["active_params"]
    assert codes["layer_bytes_per_token"] < dense["layer_bytes_per_token"]
    assert codes["b1_decode_tok_s"] > 0 and dense["b1_decode_tok_s"] > 0
