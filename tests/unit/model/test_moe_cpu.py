"""The grouped CPU expert path (moe_cpu.py, ``sidecar_int8_moe``) against the per-expert loop it replaces
for decode-sized steps: the same bits on the same quantized experts (float32 and bf16, Qwen3-MoE's and
Mixtral's routers, rows picking shared and disjoint experts), the same greedy tokens, and refusals."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import moe_cpu
from sidecar.model.moe import SparseMoE
from tests.unit.model.family_checkpoints import build_family_checkpoint

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5 + (11 * i + 5 * j) % 800 for j in range(n)] for i, n in enumerate([4, 9, 17])]


@pytest.fixture(scope="module", params=["qwen3_moe_step", "mixtral"])
def family_dir(request, tmp_path_factory, demo_dir):
    return build_family_checkpoint(request.param, tmp_path_factory.mktemp("moecpu") / request.param, demo_dir)


@pytest.fixture(scope="module")
def loaded(family_dir):
    """``get(dtype, quantization)``: the checkpoint loaded so, once per module and family."""
    cache: dict = {}

    def get(dtype: str, quantization=None) -> LLM:
        if (dtype, quantization) not in cache:
            cache[dtype, quantization] = LLM(
                model=str(family_dir),
                dtype=dtype,
                quantization=quantization,
                quant_group_size=32,  # the experts' widths (64, 96) are multiples of it
                num_kv_blocks=64,
            )
        return cache[dtype, quantization]

    return get


def _blocks(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, SparseMoE)]


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    moe.cpu_grouped = False
    try:
        return moe(x)
    finally:
        del moe.cpu_grouped  # back to the class default (on)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_expert_loop(loaded, dtype, mode):
    blocks = _blocks(loaded(str(dtype).split(".")[1], mode))
    assert blocks
    gen = torch.Generator().manual_seed(1)
    for moe in blocks:
        assert moe_cpu.CpuExperts.of(moe) is not None
        hidden = moe.gate.in_features
        for rows in (1, 2, 5, moe_cpu.MAX_ROWS):
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            weights, ids = moe.route(x)
            ids, perm = ids.sort(dim=-1)
            fast = moe_cpu.routed(moe, x, weights.gather(-1, perm), ids)
            assert fast is not None and fast.dtype == dtype
            assert torch.equal(fast, _reference(moe, x)), (rows, dtype)
            assert torch.equal(moe(x), fast)
        # two rows on the very same experts, and a step past MAX_ROWS (the loop runs it)
        x = torch.randn(1, hidden, generator=gen).to(dtype).expand(2, hidden).contiguous()
        assert torch.equal(moe(x), _reference(moe, x))
        x = torch.randn(moe_cpu.MAX_ROWS + 1, hidden, generator=gen).to(dtype)
        assert moe_cpu.routed(moe, x, *moe.route(x)) is None


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_greedy_tokens_equal_with_and_without_the_grouped_path(loaded, mode):
    llm = loaded("float32", mode)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for moe in _blocks(llm):
        moe.cpu_grouped = False
    try:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        for moe in _blocks(llm):
            del moe.cpu_grouped
    assert got == want
    assert sum(len(set(o)) > 2 for o in got) >= 2, got


def test_refused_for_float_experts_and_bad_ids(loaded):
    qmoe = _blocks(loaded("float32", "int8"))[0]
    assert moe_cpu.CpuExperts.of(SparseMoE(qmoe.args)) is None  # plain float experts: the loop runs them
    x = torch.randn(2, qmoe.gate.in_features)
    weights, ids = qmoe.route(x)
    with pytest.raises(ValueError, match="expert id"):
        moe_cpu.routed(qmoe, x, weights, ids + qmoe.num_experts)


def test_self_check_keeps_the_loop_where_the_fast_path_differs(loaded):
    blocks = _blocks(loaded("float32", "int8"))
    assert moe_cpu.self_check(blocks, torch.float32) == len(blocks)  # as at load: every block passes
    moe = blocks[0]
    tables = moe_cpu.CpuExperts.of(moe).tables
    tables[0].copy_(tables[0].flip(0))  # each expert's gate/up read from another's
    try:
        assert moe_cpu.self_check(blocks, torch.float32) == len(blocks) - 1
        assert moe_cpu.CpuExperts.of(moe) is None
        x = torch.randn(1, moe.gate.in_features)
        assert torch.equal(moe(x), _reference(moe, x))
    finally:
        moe.__dict__.pop("_cpu_experts")  # rebuilt at the next step
