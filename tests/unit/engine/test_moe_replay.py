"""CPU decode replays of mixture-of-experts models (``engine/cpu_graphs.py``): with the router in its kernel
(``kernels/cpu/moe_route.c``) and int8 / int4 / bf16 experts in the grouped expert kernels, a sparse block's
decode step is kernel calls alone, so the self-check records and replays Qwen3-MoE's and Mixtral's steps, every
batch size is planned ahead, and replayed decoding equals eager decoding token for token and log-probability for
log-probability over shrinking batches (float32 HF equality through the same kernels: test_moe_route.py). Where
the router kernel is off, steps run eagerly with the operator named."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from sidecar.model import moe_cpu
from sidecar.model.kernels.cpu import amx_gemm, moe_route, replay
from sidecar.model.moe import SparseMoE
from tests.unit.model.family_checkpoints import build_family_checkpoint

pytestmark = pytest.mark.skipif(
    replay.unavailable_reason() is not None or moe_route.unavailable_reason() is not None,
    reason="replay and the router kernel need the C kernels (a C compiler with OpenMP, AVX2 / AVX-512)",
)

PROMPTS = [[5 + (11 * i + 5 * j) % 800 for j in range(n)] for i, n in enumerate([4, 9, 17, 6])]
LENS = [6, 11, 15, 9]  # the batch shrinks 4 -> 1 rows as the requests finish


@pytest.fixture(scope="module", params=["qwen3_moe_step", "mixtral"])
def family_dir(request, tmp_path_factory, demo_dir):
    return build_family_checkpoint(
        request.param, tmp_path_factory.mktemp("moereplay") / request.param, demo_dir
    )


def _kw(family_dir, quantization) -> dict:
    return dict(
        model=str(family_dir),
        dtype="bfloat16",
        quantization=quantization,
        quant_group_size=32,  # the experts' widths (64, 96) are multiples of it
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=4,
    )


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    sp = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in LENS]
    return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in llm.generate(PROMPTS, sp)]


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """The batch size of every replayed step."""
    seen: list[int] = []
    plan_replay = replay.Plan.replay

    def counted(plan, arena):
        seen.append(plan._out[2][0])
        return plan_replay(plan, arena)

    monkeypatch.setattr(replay.Plan, "replay", counted)
    return seen


@pytest.mark.parametrize("quantization", ["int8", "int4", None])
def test_moe_decode_steps_replay_as_eager(family_dir, quantization, replays):
    if quantization is None and amx_gemm.available():
        pytest.skip("bf16 experts in AMX's tile layout: the grouped bf16 kernel does not read it")
    fast = LLM(**_kw(family_dir, quantization))
    eager = LLM(enforce_eager=True, **_kw(family_dir, quantization))
    info = fast.engine.model_info
    assert info["cpu_decode_replay"] is True, info["cpu_decode_replay_reason"]
    assert info["cpu_decode_planned"] is True, info["cpu_decode_planned_reason"]
    assert eager.engine.model_info["cpu_decode_replay"] is False
    blocks = [m for m in fast.engine.loaded.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(m.__dict__["_cpu_router"] is True for m in blocks)
    assert all(moe_cpu.CpuExperts.of(m) is not None for m in blocks)
    plans = fast.engine.runner.cpu_plans
    assert plans.recorded == [1, 2, 3, 4] and not plans.eager_sizes
    # a plan's calls: each sparse block's gate, router and grouped experts, once per step
    names = plans._plans[(1, False)].names
    assert names.count("sidecar_moe_route") == len(blocks)
    assert names.count(f"sidecar_{quantization or 'bf16'}_moe") == len(blocks)
    replays.clear()
    got = _run(fast)
    assert got == _run(eager)
    assert set(replays) == {1, 2, 3, 4}  # decode steps of every batch size were replays
    assert sum(len(set(toks)) > 2 for toks, _ in got) >= 2, got
    eng = fast.engine
    assert not eng.requests and eng.kv.num_free_blocks() == eng.kv.num_blocks


def test_steps_stay_eager_where_the_router_kernel_is_off(family_dir, monkeypatch):
    monkeypatch.setattr(moe_cpu, "router_refusal", lambda moe: "switched off")
    llm = LLM(**_kw(family_dir, "int8"))
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is False
    assert "outside our kernels" in info["cpu_decode_replay_reason"]
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs) and llm.engine.runner.cpu_plans.recorded == []


def test_int4_batches_past_the_one_row_slots_replay(family_dir, replays):
    """Decode batches past ``moe_cpu.MAX_ROWS`` rows route in the router kernel and run int4 experts' grouped
    kernel, so they are planned and replayed too, with eager decoding's tokens."""
    kw = dict(_kw(family_dir, "int4"), max_num_seqs=12)
    fast, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    plans = fast.engine.runner.cpu_plans
    prompts = [[5 + (13 * i + 7 * j) % 800 for j in range(3 + i % 5)] for i in range(12)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)

    def run(llm: LLM) -> list:
        return [(o.token_ids, [t.logprob for t in o.logprobs]) for o in llm.generate(prompts, sp)]

    replays.clear()
    got = run(fast)
    assert got == run(eager)
    assert 12 in replays and 12 not in plans.eager_sizes, (replays, plans.eager_sizes)
    blocks = [m for m in fast.engine.loaded.model.modules() if isinstance(m, SparseMoE)]
    names = plans._plans[(12, False)].names
    assert names.count("sidecar_moe_route") == len(blocks), names
    assert names.count("sidecar_int4_moe_grouped") == len(blocks), names
    assert sum(len(set(toks)) > 2 for toks, _ in got) >= 6, got
