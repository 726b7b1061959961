"""gpt-oss beyond the shared MoE comparisons (test_moe_vs_hf.py): MXFP4 weights dequantized bit for bit as
transformers' own dequantizer does, a checkpoint that ships them (the published form) equal to transformers
loading the same directory, the sparse block (biased router, top-k softmax, clamped SwiGLU) against
transformers' on rows that pick disjoint and identical experts, and attention sinks in the scored (H2O)
attention path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model import mxfp4
from sidecar.model.loader import load_model
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5 + (11 * i + 5 * j) % 900 for j in range(n)] for i, n in enumerate([7, 26, 41, 15])]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, demo_dir):
    return build_family_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "ckpt", demo_dir)


def to_mxfp4(src, out):
    """A copy of the checkpoint ``src`` at ``out`` with its experts as the published checkpoints ship them:
    ``*_blocks`` and ``*_scales`` (random codes, scales 2^-5 .. 2^-1) and ``quantization_config.quant_method:
    mxfp4``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # transformers: [experts, in, out]
        groups = cols // mxfp4.BLOCK
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, groups, 16), generator=g).to(
            torch.uint8
        )
        tensors[f"{name}_scales"] = torch.randint(122, 127, (experts, rows, groups), generator=g).to(
            torch.uint8
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def mxfp4_dir(gpt_oss_dir, tmp_path_factory):
    """The tiny checkpoint with MXFP4 experts (``to_mxfp4``)."""
    return to_mxfp4(gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantizes_as_transformers_does(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g).to(torch.uint8)
    # every code in every nibble, and scales over the whole e8m0 range but NaN's 255 (2^-127 .. 2^127)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17
    scales = torch.randint(0, 255, (3, 40, 4), generator=g).to(torch.uint8)
    scales[0, :2, :2] = torch.tensor([[0, 1], [253, 254]], dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype).transpose(1, 2)
    assert ours.dtype == dtype and ours.shape == (3, 40, 128)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))  # -0.0 codes stay negative zeros
    assert torch.equal(ours[0, 0, :32:2], torch.tensor(mxfp4.E2M1, dtype=dtype) * 2.0**-127)


def test_mxfp4_refuses_blocks_that_do_not_match_their_scales():
    blocks = torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mxfp4: blocks"):
        mxfp4.dequantize(blocks, torch.zeros(2, 8, 3, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(blocks, torch.zeros(2, 8, 2, dtype=torch.int32), torch.float32)


def test_an_mxfp4_checkpoint_matches_transformers_loading_it(mxfp4_dir):
    ref = hf_greedy(mxfp4_dir, PROMPTS, MAX_NEW)
    # a block pages one KV group (two of the four layers, engine/kv_groups.py): 18 of them are the bytes of
    # 9 four-layer blocks
    llm = LLM(
        model=str(mxfp4_dir), dtype="float32", block_size=8, num_kv_blocks=19, max_num_batched_tokens=16
    )
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)


def test_the_sparse_block_matches_transformers(gpt_oss_dir):
    from transformers import AutoModelForCausalLM

    ours = load_model(EngineConfig(model=str(gpt_oss_dir), dtype="float32")).model
    hf = AutoModelForCausalLM.from_pretrained(str(gpt_oss_dir), dtype=torch.float32)
    torch.manual_seed(0)
    a, b = torch.randn(2, ours.args.hidden_size) * 3
    for layer in (0, 3):
        moe, hf_block = ours.layers[layer].mlp, hf.model.layers[layer].mlp
        for x in (a[None], torch.stack((a, a, b)), torch.randn(6, ours.args.hidden_size) * 3):
            with torch.no_grad():
                weights, ids = moe.route(x)
                _, hf_weights, hf_ids = hf_block.router(x)
                got, want = moe(x), hf_block(x[None])[0][0]
            # the router kernel gives a row's experts in ascending id (``route``), HF's best first
            ids, weights = _ascending(ids, weights)
            hf_ids, hf_weights = _ascending(hf_ids, hf_weights)
            assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, rtol=1e-5, atol=1e-7)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
            if x.shape[0] == 3:
                assert torch.equal(ids[0], ids[1]) and torch.equal(got[0], got[1])
                assert not torch.equal(ids[0], ids[2])


def _ascending(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, perm = ids.sort(dim=-1)
    return ids, weights.gather(-1, perm)


def test_sinks_in_the_scored_attention_path(tmp_path, demo_dir):
    """With H2O eviction on (a budget no sequence reaches; the engine allows it only without sliding
    windows) every attention call also adds up the weight each key receives; the sink takes its share of
    the softmax there too, so the output stays HF's."""
    path = build_family_checkpoint("gpt_oss", tmp_path / "full", demo_dir, layer_types=["full_attention"] * 4)
    ref = hf_greedy(path, PROMPTS[:2], MAX_NEW)
    llm = LLM(model=str(path), dtype="float32", kv_budget=256, kv_eviction="h2o")
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == ref
    assert float(llm.engine.runner.kv_scores.sum()) > 0


def test_the_self_check_keeps_the_triton_attention_off_for_sinks(gpt_oss_dir):
    from sidecar.engine import self_check

    llm = LLM(model=str(gpt_oss_dir), dtype="float32", num_kv_blocks=64)
    fallbacks = self_check.run(llm.engine.runner, ["attention"])
    assert "sinks" in fallbacks["attention"] and not llm.engine.runner.fast_paths.attention
    out = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == hf_greedy(gpt_oss_dir, PROMPTS[:1], MAX_NEW)[0]


def _expert_bytes(model) -> int:
    experts = [m for layer in model.layers for m in layer.mlp.experts.modules()]
    tensors = [t for m in experts for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_mxfp4_experts_keep_their_codes_on_the_cpu(mxfp4_dir, monkeypatch):
    """Loaded for the CPU the experts hold their codes (4.25 bits a weight, plus float32 biases) and compute what
    the experts dequantized at load compute, to float32 summation order; with the codes off (what a device
    without the kernel gets), or plain weights asked for, they are plain layers again."""
    from sidecar.model.linear import Linear

    kept = load_model(EngineConfig(model=str(mxfp4_dir), dtype="float32")).model
    # callers that read or save plain weights (``sidecar quantize``) get them dequantized
    plain = load_model(EngineConfig(model=str(mxfp4_dir), dtype="float32"), pack=False).model
    assert plain.layers[0].mlp.experts[1].down_proj.weight.dtype == torch.float32
    monkeypatch.setenv(mxfp4.CODES_ENV, "0")
    dense = load_model(EngineConfig(model=str(mxfp4_dir), dtype="float32")).model
    args = kept.args
    h, width, n = args.hidden_size, args.expert_intermediate_size, args.num_experts * args.num_layers
    weights = n * 3 * h * width
    biases = n * (2 * width + h) * 4
    assert _expert_bytes(kept) == weights // 2 + weights // 32 + biases
    assert _expert_bytes(dense) == weights * 4 + biases
    for layer_k, layer_d in zip(kept.layers, dense.layers):
        for e_k, e_d in zip(layer_k.mlp.experts, layer_d.mlp.experts):
            assert isinstance(e_k.gate_up_proj, mxfp4.Mxfp4Linear)
            assert isinstance(e_k.down_proj, mxfp4.Mxfp4Linear)
            assert isinstance(e_d.gate_up_proj, Linear)
            assert torch.equal(e_k.gate_up_proj.dense_weight(), e_d.gate_up_proj.dense_weight())
    torch.manual_seed(0)
    for x in (torch.randn(1, h) * 3, torch.randn(5, h) * 3):
        with torch.no_grad():
            got, want = kept.layers[1].mlp(x), dense.layers[1].mlp(x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
