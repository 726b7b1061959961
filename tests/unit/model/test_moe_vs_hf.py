"""Mixtral, Qwen3-MoE and gpt-oss checkpoints (family_checkpoints.py) through the engine: greedy float32 equal to HF
transformers ``generate`` token for token with a tight pool (preemption), a small token budget (chunked
prefill) and prefix-cache hits; the sparse block against transformers' own on rows that pick disjoint and
identical experts, reading only the experts some row picked, each once; transformers' fused expert layout
loading like the hub's per-expert one; bf16 on the CPU kernels; parameter counts against the HF model's."""

from __future__ import annotations

import json

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.kernels.cpu import amx_gemm, moe_route, replay
from sidecar.model.loader import load_model
from sidecar.model.moe import SparseMoE
from sidecar.model.param_count import parameter_counts
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import MOE_FAMILIES, build_family_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 40, 14, 22, 16])]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("moe")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in MOE_FAMILIES}


@pytest.fixture(scope="module")
def hf_refs(moe_dirs):
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = hf_greedy(moe_dirs[kind], PROMPTS, MAX_NEW)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_greedy_matches_hf_with_preemption_chunking_and_prefix_hits(moe_dirs, hf_refs, kind):
    ref = hf_refs(kind)
    llm = LLM(
        model=str(moe_dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,
        max_num_batched_tokens=16,
    )
    args = llm.engine.loaded.args
    assert args.architecture == llm.engine.loaded.hf_config["architectures"][0]
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in llm.engine.loaded.model.layers]
    assert (
        sparse
        == {
            "mixtral": [True] * 3,
            "qwen3_moe": [False, True, False, True],
            "qwen3_moe_step": [False, True, False],
            "gpt_oss": [True] * 4,
        }[kind]
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)
    first, again = (llm.generate(PROMPTS[3:4], GREEDY)[0] for _ in range(2))
    assert first.token_ids == again.token_ids == ref[3]
    assert again.num_cached_tokens >= 32
    assert_pool_whole(llm)


def _expert_calls(moe: SparseMoE) -> tuple[dict[int, list[int]], list]:
    """Rows each expert's MLP was called with, per call."""
    calls: dict[int, list[int]] = {}
    handles = [
        expert.register_forward_hook(lambda m, inp, out, e=e: calls.setdefault(e, []).append(inp[0].shape[0]))
        for e, expert in enumerate(moe.experts)
    ]
    return calls, handles


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_sparse_block_matches_transformers_and_reads_only_picked_experts(moe_dirs, kind):
    from transformers import AutoModelForCausalLM

    path = moe_dirs[kind]
    ours = load_model(EngineConfig(model=str(path), dtype="float32")).model
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    layer = 1  # sparse in both
    moe, hf_block = ours.layers[layer].mlp, hf.model.layers[layer].mlp
    torch.manual_seed(0)
    a, b = torch.randn(2, ours.args.hidden_size)
    for x in (a[None], torch.stack((a, a, b)), torch.randn(5, ours.args.hidden_size)):
        weights, ids = moe.route(x)
        picked = sorted(set(ids.flatten().tolist()))
        assert len(picked) < moe.num_experts  # some expert goes unpicked: it must not be read
        calls, handles = _expert_calls(moe)
        with torch.no_grad():
            got = moe(x)
            want = hf_block(x[None])[0]
        for h in handles:
            h.remove()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
        # each picked expert runs once, over every row that picked it; the others never run
        assert sorted(calls) == picked
        assert all(calls[e] == [int((ids == e).sum())] for e in picked)
        if x.shape[0] == 3:  # identical rows pick identical experts
            assert torch.equal(ids[0], ids[1]) and torch.equal(got[0], got[1])


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_block_adds_each_tokens_experts_in_transformers_order(moe_dirs, kind):
    # transformers adds expert outputs into a zeroed output, one index_add per expert in ascending id; with
    # more than two experts a token, any other order rounds differently in float32. The experts' own outputs
    # are ours here (same rows, same kernels), so only the way they are combined is under test.
    moe = load_model(EngineConfig(model=str(moe_dirs[kind]), dtype="float32")).model.layers[1].mlp
    moe.top_k = 3  # three terms a token: the sum's association shows
    torch.manual_seed(1)
    x = torch.randn(9, moe.args.hidden_size)
    with torch.no_grad():
        weights, ids = moe.route(x)
        want = torch.zeros_like(x)
        for e in sorted(set(ids.flatten().tolist())):
            tok, pos = torch.where(ids == e)
            want.index_add_(0, tok, moe.experts[e](x[tok]) * weights[tok, pos, None])
        got = moe(x)
    assert torch.equal(got, want)


def test_transformers_fused_expert_layout_loads_like_the_hub_layout(moe_dirs, hf_refs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = moe_dirs["mixtral"]
    tensors = load_file(str(src / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".block_sparse_moe." not in name:
            fused[name] = t
    for i in range(3):
        p = f"model.layers.{i}.block_sparse_moe"
        e = [f"{p}.experts.{j}" for j in range(8)]
        fused[f"model.layers.{i}.mlp.gate.weight"] = tensors[f"{p}.gate.weight"]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((tensors[f"{x}.w1.weight"], tensors[f"{x}.w3.weight"])) for x in e]
        )
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([tensors[f"{x}.w2.weight"] for x in e])
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(tmp_path / "model.safetensors"))
    outs = LLM(model=str(tmp_path), dtype="float32").generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == hf_refs("mixtral")[:3]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_bf16_runs_on_the_cpu_kernels(moe_dirs, kind):
    model = str(moe_dirs[kind])
    llm = LLM(model=model, dtype="bfloat16")
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    f32 = LLM(model=model, dtype="float32").generate(PROMPTS, GREEDY)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(outs, f32)) >= len(PROMPTS) // 2
    info = llm.engine.model_info
    kernels = moe_route.unavailable_reason() is None and replay.unavailable_reason() is None
    if kind == "gpt_oss" or amx_gemm.available() or not kernels:
        # gpt-oss's experts (biases, clamped SwiGLU), bf16 experts in AMX's tile layout, or a CPU without the
        # router or replay kernels: torch operators run, the C replay refuses the step and says so
        assert info["cpu_decode_replay"] is False and info["cpu_decode_replay_reason"]
    else:  # the router kernel and the grouped bf16 experts: the step is kernel calls alone
        assert info["cpu_decode_replay"] is True, info["cpu_decode_replay_reason"]
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_parameter_counts_match_the_hf_model(moe_dirs, kind):
    from transformers import AutoModelForCausalLM

    from sidecar.model.args import ModelArgs

    path = moe_dirs[kind]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    total = sum(p.numel() for p in hf.parameters())  # a tied head's table counts once
    idle = 0  # parameters of the experts a token does not use
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            n = sum(p.numel() for p in experts.parameters())
            idle += n - n * args.experts_per_token // args.num_experts
    assert parameter_counts(args) == (total, total - idle)
