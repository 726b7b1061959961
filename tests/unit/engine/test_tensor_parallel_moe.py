"""Tensor parallelism of mixtures of experts over gloo on CPU: every rank holds every expert's slice of the
intermediate dimension (and the router whole), and two ranks give HF float32's greedy tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.args import ModelArgs
from sidecar.model.loader import load_model
from sidecar.model.tp_shard import Shard
from tests.unit.engine.test_engine_vs_hf import hf_generate

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _build(kind: str, out, demo_dir):
    from tests.unit.model.family_checkpoints import build_family_checkpoint
    from tests.unit.model.llama4_checkpoints import build_llama4_checkpoint
    from tests.unit.model.test_gpt_oss import to_mxfp4

    if kind == "llama4":
        return build_llama4_checkpoint(kind, out, demo_dir)
    if kind == "gpt_oss_mxfp4":
        return to_mxfp4(build_family_checkpoint("gpt_oss", out.with_name("gpt_oss_src"), demo_dir), out)
    return build_family_checkpoint(kind, out, demo_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("tpmoe")
    kinds = ("mixtral", "qwen3_moe_step", "gpt_oss", "gpt_oss_mxfp4", "llama4")
    return {kind: _build(kind, root / kind / "ckpt", demo_dir) for kind in kinds}


def _prompts(vocab: int):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    shared = [rng.randrange(3, vocab) for _ in range(24)]  # three full 8-token blocks
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(3)]]


def _pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not llm.engine.requests and not kv.req_blocks
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


def _halves(parts: list[torch.Tensor]) -> torch.Tensor:
    """The fused gate/up rows of one process rebuilt from the ranks' own (gate rows first on each)."""
    h = parts[0].shape[0] // 2
    return torch.cat([p[:h] for p in parts] + [p[h:] for p in parts])


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe_step", "gpt_oss", "gpt_oss_mxfp4", "llama4"])
def test_expert_slices_rejoin_into_one_process_weights(checkpoints, kind):
    """Each checkpoint layout (per-expert tensors, gpt-oss's interleaved gate/up and its MXFP4 codes, Llama 4's
    fused inputs-first experts and shared expert): the two ranks' gate/up rows and down columns of every expert
    are one process's, the router is whole on both, an expert's down bias is on rank 0 only."""
    cfg = EngineConfig(model=str(checkpoints[kind]), dtype="float32")
    whole = load_model(cfg, pack=False).model
    ranks = [load_model(cfg, pack=False, shard=Shard(r, 2)).model for r in (0, 1)]
    sparse = [i for i in range(whole.args.num_layers) if whole.args.sparse(i)]
    assert sparse
    for i in sparse:
        one, split = whole.layers[i].mlp, [m.layers[i].mlp for m in ranks]
        pairs = [(one.experts[e], [s.experts[e] for s in split]) for e in range(one.num_experts)]
        if one.shared_expert is not None:
            pairs.append((one.shared_expert, [s.shared_expert for s in split]))
        for mlp, parts in pairs:
            gu, down = mlp.gate_up_proj, mlp.down_proj
            assert torch.equal(_halves([p.gate_up_proj.weight for p in parts]), gu.weight)
            assert torch.equal(torch.cat([p.down_proj.weight for p in parts], 1), down.weight)
            assert parts[0].down_proj.weight.shape[1] * 2 == down.weight.shape[1]
            if gu.bias is not None:
                assert torch.equal(_halves([p.gate_up_proj.bias for p in parts]), gu.bias)
                assert torch.equal(parts[0].down_proj.bias, down.bias)
                assert not parts[1].down_proj.bias.any()
        for s in split:
            assert torch.equal(s.gate.weight, one.gate.weight)
    if whole.args.attn_sinks:
        sinks = [m.layers[0].self_attn.sinks for m in ranks]
        assert torch.equal(torch.cat(sinks), whole.layers[0].self_attn.sinks)


def test_int4_experts_quantized_per_rank_hold_one_process_codes(checkpoints):
    """Each rank quantizes its experts' slices on load. With 32-column groups no group straddles the ranks'
    split of an expert's down columns (32 of 64 each), so the ranks' layers, read out column by column
    (products with the identity), are one process's layers split."""
    cfg = EngineConfig(
        model=str(checkpoints["qwen3_moe_step"]), dtype="float32", quantization="int4", quant_group_size=32
    )
    whole = load_model(cfg).model
    ranks = [load_model(cfg, shard=Shard(r, 2)).model for r in (0, 1)]

    def read(lin) -> torch.Tensor:
        with torch.inference_mode():
            return lin(torch.eye(lin.in_features)).t()  # [out, in]: what the layer multiplies by

    for e, one in enumerate(whole.layers[1].mlp.experts):
        split = [m.layers[1].mlp.experts[e] for m in ranks]
        assert type(one.down_proj).__name__ == type(split[0].down_proj).__name__ == "Int4Linear"
        assert torch.equal(_halves([read(s.gate_up_proj) for s in split]), read(one.gate_up_proj))
        assert torch.equal(torch.cat([read(s.down_proj) for s in split], 1), read(one.down_proj))


def test_splits_that_do_not_fall_on_experts_or_blocks_are_refused(checkpoints):
    args = ModelArgs.from_hf_config(
        {
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "max_position_embeddings": 64,
        }
    )
    with pytest.raises(ValueError, match="tensor_parallel_size: .* expert intermediate size 48"):
        Shard(0, 5).local_args(dataclasses.replace(args, num_heads=5, num_kv_heads=5, intermediate_size=50))
    with pytest.raises(ValueError, match="tensor_parallel_size: .* shared expert intermediate size 30"):
        Shard(0, 4).local_args(dataclasses.replace(args, shared_expert_size=30))
    assert Shard(1, 2).ranges(args)["expert"] == (24, 48)
    # 64 MXFP4 columns over 4 ranks: 16 each, inside one 32-column block
    mxfp4 = EngineConfig(model=str(checkpoints["gpt_oss_mxfp4"]), dtype="float32")
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks split the MXFP4 experts' 64"):
        load_model(mxfp4, pack=False, shard=Shard(1, 4))


@pytest.fixture(scope="module")
def qwen3_moe(checkpoints):
    """Qwen3-MoE over two ranks (dense layers between sparse ones, tied head), a tight pool and a small token
    budget; HF's greedy tokens."""
    import transformers as tf

    path = checkpoints["qwen3_moe_step"]
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(
        model=str(path),
        dtype="float32",
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=12,  # 88 tokens for five requests of up to 48: preemption
        max_num_batched_tokens=16,  # prompts arrive in chunks
    )
    try:
        yield llm, prompts, hf_generate(hf, prompts, MAX_NEW)
    finally:
        llm.engine.tp.close()


def test_two_ranks_of_experts_match_hf_with_preemption_chunks_and_prefix_hits(qwen3_moe):
    llm, prompts, ref = qwen3_moe
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert llm.stats()["num_preemptions"] > 0
    _pool_whole(llm)
    again = llm.generate([prompts[-1]], GREEDY)[0]
    assert again.token_ids == ref[-1] and again.num_cached_tokens >= 24
    _pool_whole(llm)
    # The grouped expert GEMM (and every device path) is off on every rank, for the reason named.
    assert llm.engine.model_info["fast_path_fallbacks"]["moe"] == "tensor_parallel_size 2"


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss_mxfp4", "llama4"])
def test_two_ranks_of_each_family_match_hf(checkpoints, kind):
    """Mixtral (float32 routing weights, per-expert w1 / w3 / w2 tensors); gpt-oss with MXFP4 experts (their
    codes sliced per rank and read by the MXFP4 kernel on each: expert and router biases, the clamped SwiGLU,
    attention sinks); Llama 4 (a shared expert beside the routed ones, sigmoid-weighed expert inputs, dense
    layers between); each with preemption and chunked prefill."""
    from sidecar.model import mxfp4
    from tests.unit.engine.test_engine_vs_hf import hf_greedy

    path = checkpoints[kind]
    prompts = _prompts(200)[:4]
    ref = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(
        model=str(path),
        dtype="float32",
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
    )
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        assert llm.stats()["num_preemptions"] > 0
        _pool_whole(llm)
        if kind == "gpt_oss_mxfp4" and not mxfp4.keeps_codes(torch.device("cpu"), None):
            expert = llm.engine.runner.model.layers[0].mlp.inner.experts[0]
            assert isinstance(expert.down_proj, mxfp4.Mxfp4Linear)
            assert expert.down_proj.blocks.shape[1] == 1  # 32 of the 64 columns: one block
    finally:
        llm.engine.tp.close()
