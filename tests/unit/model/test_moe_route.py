"""The router kernel (``kernels/cpu/moe_route.c``, ``moe_cpu.kernel_route``) against torch's router
(``SparseMoE.route_logits``): the same expert ids and weights, bit for bit, on random logits and on logits full of
ties (torch.topk's pick among equal values, which is not the lowest index), float32 and bf16, with and without
renormalisation, and the routers that pick first (gpt-oss's softmax after top-k, Llama 4's sigmoid); the
load-time check turning it on per block, its fallback to torch's router where the kernel differs, routers the
kernel does not take refused by name, and greedy float32 decoding through it equal to HF transformers."""

from __future__ import annotations

import logging

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import moe_cpu
from sidecar.model.kernels.cpu import moe_route
from sidecar.model.moe import SparseMoE
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint

pytestmark = pytest.mark.skipif(
    moe_route.unavailable_reason() is not None,
    reason="the router kernel needs a C compiler and AVX2 / AVX-512",
)

MAX_NEW = 10
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 9])]


def _torch_router(logits, k, norm, wdtype):
    """torch's router as ``SparseMoE`` runs it (softmax first), ids then sorted as ``forward`` sorts them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, perm = ids.sort(dim=-1)
    return weights.to(wdtype).gather(-1, perm), ids


# (experts, k): the sizes of the tiny models, Qwen3-30B-A3B's, the partial-sort path (64 k <= E), tails of
# the softmax's vectors and renormalised sums of every association
SHAPES = [(8, 2), (6, 2), (8, 3), (128, 8), (128, 2), (60, 5), (33, 7), (256, 8), (24, 17), (3, 1)]


@pytest.mark.parametrize("experts,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_routes_as_torch(experts, k, dtype):
    gen = torch.Generator().manual_seed(experts * 100 + k)
    for trial in range(40):
        rows = moe_cpu.ROUTE_ROWS if trial >= 38 else 1 + trial % 4  # the last two: a batch of the most rows
        if trial % 2:  # a few distinct values: equal probabilities straddle the k-th place
            logits = torch.randint(0, 1 + trial % 4, (rows, experts), generator=gen).float()
        else:
            logits = torch.randn(rows, experts, generator=gen) * (0.2 + trial % 9)
        logits = logits.to(dtype)
        for norm in (False, True):
            for wdtype in (torch.float32, torch.bfloat16):
                got = moe_route.route(logits, k, norm, wdtype)
                want = _torch_router(logits, k, norm, wdtype)
                assert got is not None and got[0].dtype == wdtype
                assert torch.equal(got[1], want[1]), (trial, norm, got[1], want[1])
                assert torch.equal(got[0], want[0]), (trial, norm, wdtype)


def _torch_picked(logits, k, form, wdtype):
    """torch's routers that pick first as ``SparseMoE.route_logits`` runs them, ids then sorted."""
    values, ids = torch.topk(logits, k, dim=-1)
    if form == moe_route.PICKED_SOFTMAX:
        weights = torch.softmax(values, dim=-1)
    else:
        weights = torch.sigmoid(values.float())
    ids, perm = ids.sort(dim=-1)
    return weights.to(wdtype).gather(-1, perm), ids


@pytest.mark.parametrize("experts,k", [(8, 2), (8, 3), (4, 1), (32, 4), (128, 8), (60, 5), (24, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [1, 2])
def test_routers_that_pick_first_route_as_torch(experts, k, dtype, form):
    gen = torch.Generator().manual_seed(experts * 100 + k + form)
    for trial in range(24):
        # up to MAX_ROWS: sigmoids in torch's vector loop and in its scalar tail; the last two: the most rows
        rows = moe_cpu.ROUTE_ROWS if trial >= 22 else 1 + trial % 7
        if trial % 2:
            logits = torch.randint(-2, 2 + trial % 3, (rows, experts), generator=gen).float()
        else:
            logits = torch.randn(rows, experts, generator=gen) * (0.2 + trial % 9)
        logits = logits.to(dtype)
        for wdtype in (torch.float32, torch.bfloat16) if form == 2 else (dtype,):
            got = moe_route.route_picked(logits, k, form, wdtype)
            want = _torch_picked(logits, k, form, wdtype)
            assert got is not None and got[0].dtype == wdtype
            assert torch.equal(got[1], want[1]), (trial, got[1], want[1])
            assert torch.equal(got[0], want[0]), (trial, wdtype, got[0], want[0])


def test_ties_pick_torchs_experts_not_the_lowest_ids():
    # all experts equal: torch's selection (nth_element) does not keep the lowest ids, so neither may the kernel;
    # past 64 k <= E torch's heap select keeps them
    for experts, k in ((8, 2), (8, 3), (128, 8), (128, 2)):
        logits = torch.zeros(1, experts)
        torch_ids = torch.topk(torch.softmax(logits, -1), k).indices.sort().values
        lowest = torch.equal(torch_ids[0], torch.arange(k))
        assert lowest is (64 * k <= experts)
        weights, ids = moe_route.route(logits, k, True, torch.float32)
        assert torch.equal(ids, torch_ids)
        assert torch.equal(weights, torch.full((1, k), 1.0 / k))


def test_arguments_the_kernel_does_not_take():
    logits = torch.randn(2, 8)
    assert moe_route.route(logits, 9, True, torch.float32) is None  # more picks than experts
    assert moe_route.route(logits, 0, True, torch.float32) is None
    assert moe_route.route(logits.half(), 2, True, torch.float32) is None
    assert moe_route.route(logits.t(), 2, True, torch.float32) is None  # rows not contiguous
    assert moe_route.route(logits, 2, True, torch.int32) is None


# ------------------------------------------------------------------ per block, at load


@pytest.fixture(scope="module", params=["qwen3_moe_step", "mixtral"])
def family_dir(request, tmp_path_factory, demo_dir):
    return build_family_checkpoint(request.param, tmp_path_factory.mktemp("route") / request.param, demo_dir)


def _blocks(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, SparseMoE)]


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The rows of every call the router kernel routes."""
    seen: list[int] = []
    kernel = moe_route.route

    def count(logits, *args):
        out = kernel(logits, *args)
        if out is not None:
            seen.append(logits.shape[0])
        return out

    monkeypatch.setattr(moe_route, "route", count)
    return seen


def test_float32_decoding_through_the_kernel_equals_hf(family_dir, counted):
    llm = LLM(model=str(family_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
    blocks = _blocks(llm)
    assert blocks and all(m.__dict__["_cpu_router"] is True for m in blocks)
    counted.clear()
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    assert got == hf_greedy(family_dir, PROMPTS, MAX_NEW)
    # every decode step of every sparse block routed in the kernel (prompts' chunks too, where small)
    assert len(counted) >= len(blocks) * (MAX_NEW - 1) and max(counted) <= moe_cpu.ROUTE_ROWS


def test_a_block_whose_kernel_differs_keeps_torchs_router(family_dir, monkeypatch, caplog):
    llm = LLM(model=str(family_dir), dtype="float32", quantization="int8", num_kv_blocks=64)
    blocks = _blocks(llm)
    assert moe_cpu.self_check(blocks, torch.float32) == len(blocks)
    assert all(m.__dict__["_cpu_router"] is True for m in blocks)
    kernel = moe_route.route

    def off_by_an_ulp(logits, k, norm, wdtype):
        weights, ids = kernel(logits, k, norm, wdtype)
        return torch.nextafter(weights, torch.full_like(weights, 2.0)), ids

    monkeypatch.setattr(moe_route, "route", off_by_an_ulp)
    with caplog.at_level(logging.WARNING, logger="sidecar.model"):
        moe_cpu.self_check(blocks, torch.float32)
    assert "differ from torch's" in caplog.text
    moe = blocks[0]
    assert "differ" in moe.__dict__["_cpu_router"]
    x = torch.randn(1, moe.gate.in_features)
    assert moe_cpu.kernel_route(moe, moe.gate(x), x.dtype) is None and moe_cpu.decode_step(moe, x) is None
    moe.cpu_grouped = False
    try:
        want = moe(x)
    finally:
        del moe.cpu_grouped
    assert torch.equal(moe(x), want)  # torch's router, then the grouped experts


def test_routers_that_pick_first_are_checked_and_others_refused_by_name(family_dir):
    llm = LLM(model=str(family_dir), dtype="float32", num_kv_blocks=64)
    moe = _blocks(llm)[0]
    assert moe_cpu.router_refusal(moe) is None
    for attr in ("sigmoid_input", "softmax_after_topk"):  # Llama 4's and gpt-oss's forms over this block
        setattr(moe, attr, True)
        try:
            assert moe_cpu.router_refusal(moe) is None
            assert moe_cpu.check_router(moe, torch.float32) is True
            x = torch.randn(2, moe.gate.in_features)
            assert moe_cpu.kernel_route(moe, moe.gate(x), x.dtype) is not None
        finally:
            setattr(moe, attr, False)
    k = moe.top_k
    moe.top_k = moe_route.MAX_K + 1
    try:
        assert "experts per token" in moe_cpu.router_refusal(moe)
        assert moe_cpu.check_router(moe, torch.float32) is False
    finally:
        moe.top_k = k
    assert moe_cpu.check_router(moe, torch.float32) is True
