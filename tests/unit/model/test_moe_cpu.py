"""The grouped CPU expert path (moe_cpu.py: ``sidecar_int8_moe``, ``sidecar_int4_moe``, ``sidecar_bf16_moe``)
against the per-expert loop it replaces for decode-sized steps: the same bits on the same experts (int8 / int4
in float32 and bf16, bf16 experts in the layout the model holds and in plain rows; Qwen3-MoE's and Mixtral's
routers, rows picking shared and disjoint experts), the same greedy tokens, and refusals."""

from __future__ import annotations

import contextlib

import dataclasses

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import moe_cpu, moe_int4_batched
from sidecar.model.kernels.cpu import int4_gemv
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE
from sidecar.model.quant import Int4Linear, quantize_linear
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


@contextlib.contextmanager
def _on_the_loop(blocks: list[SparseMoE]):
    """Inside the ``with``, ``blocks`` run the per-expert loop (``cpu_grouped`` off)."""
    for moe in blocks:
        moe.cpu_grouped = False
    try:
        yield
    finally:
        for moe in blocks:
            del moe.cpu_grouped  # back to the class default (on)


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    with _on_the_loop([moe]):
        return moe(x)


def _loop_tokens(llm: LLM, prompts) -> list:
    """Greedy tokens of ``prompts`` with every block on the per-expert loop."""
    with _on_the_loop(_blocks(llm)):
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _in_amx_layout(moe: SparseMoE) -> bool:
    """bf16 experts held in AMX's tile layout (CPUs with AMX or AVX-512 BF16), which the grouped kernel does not
    read: the loop runs them there."""
    return getattr(moe.experts[0].gate_up_proj, "amx", None) is not None


def _equal_the_loop(moe: SparseMoE, dtype: torch.dtype, gen: torch.Generator) -> None:
    """The grouped path against the loop on the block's steps: 1 to MAX_ROWS rows, two rows on the very same
    experts, and a step past MAX_ROWS (int4 experts: their grouped kernel of many rows, else the loop)."""
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
    x = torch.randn(1, hidden, generator=gen).to(dtype).expand(2, hidden).contiguous()
    assert torch.equal(moe(x), _reference(moe, x))
    x = torch.randn(moe_cpu.MAX_ROWS + 1, hidden, generator=gen).to(dtype)
    weights, ids = moe.route(x)
    ids, perm = ids.sort(dim=-1)
    fast = moe_cpu.routed(moe, x, weights.gather(-1, perm), ids)
    if moe_cpu.CpuExperts.of(moe).batched is None or dtype not in moe_cpu.CpuExperts.of(moe).batched.dtypes:
        assert fast is None
    else:
        assert type(moe.experts[0].gate_up_proj) is Int4Linear
        assert fast is not None and torch.equal(fast, _reference(moe, x)), dtype


@pytest.mark.parametrize(
    "dtype,mode",
    [
        (torch.float32, "int8"),
        (torch.bfloat16, "int8"),
        (torch.float32, "int4"),
        (torch.bfloat16, "int4"),
        (torch.bfloat16, None),  # bf16 experts (sidecar_bf16_moe), in the layout the model holds them in
    ],
)
def test_grouped_experts_equal_the_per_expert_loop(loaded, dtype, mode):
    blocks = _blocks(loaded(str(dtype).split(".")[1], mode))
    assert blocks
    gen = torch.Generator().manual_seed(1)
    for moe in blocks:
        if _in_amx_layout(moe):
            assert moe_cpu.CpuExperts.of(moe) is None
            continue
        _equal_the_loop(moe, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_grouped_experts_equal_the_loop_at_any_thread_count(loaded, dtype):
    """``sidecar_int4_moe`` runs whole slots a thread where the threads share a step's slots evenly (one thread,
    or two) and splits each step's products across them where they do not (three threads for the steps' 2 to
    14 slots): the loop's bits either way."""
    blocks = _blocks(loaded(str(dtype).split(".")[1], "int4"))
    gen = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for moe in blocks:
                _equal_the_loop(moe, dtype, gen)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,mode", [("float32", "int8"), ("float32", "int4"), ("bfloat16", None)])
def test_greedy_tokens_equal_with_and_without_the_grouped_path(loaded, dtype, mode):
    llm = loaded(dtype, mode)
    assert all(moe_cpu.CpuExperts.of(m) is not None or _in_amx_layout(m) for m in _blocks(llm))
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == _loop_tokens(llm, PROMPTS)
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


def _plain_copy(moe: SparseMoE) -> SparseMoE:
    """A copy of the block with every weight plain bf16 rows (no tiled or tile layout): the layers then run
    ``bf16_gemv.bf16_matmul`` on them, and the grouped kernel reads the plain rows."""
    copy = SparseMoE(moe.args)
    for mine, theirs in zip(copy.modules(), moe.modules()):
        if isinstance(mine, Linear):
            mine.weight = torch.nn.Parameter(theirs.dense_weight().detach().clone(), requires_grad=False)
    return copy.to(torch.bfloat16).eval()


def test_bf16_experts_in_plain_rows_and_refusals(loaded):
    gen = torch.Generator().manual_seed(2)
    moe = _blocks(loaded("bfloat16"))[0]
    held = moe_cpu.CpuExperts.of(moe)
    plain = _plain_copy(moe)
    ex = moe_cpu.CpuExperts.of(plain)
    assert ex is not None and ex.extra["tiled"] == 0
    if _in_amx_layout(moe):
        assert held is None
    else:  # the tiled layout where the model holds it (AVX2 CPUs), else plain rows
        assert held.extra["tiled"] == int(moe.experts[0].gate_up_proj.tiled is not None)
    with torch.no_grad():
        _equal_the_loop(plain, torch.bfloat16, gen)
        x = torch.randn(3, moe.gate.in_features, generator=gen).bfloat16()
        assert moe_cpu.routed(plain, x.float(), *plain.route(x)) is None  # bf16 experts take bf16 rows alone
        # experts whose own layers would take oneDNN past 2 rows: steps of more rows are the loop's
        for e in plain.experts:
            e.gate_up_proj.kernel_rows = e.down_proj.kernel_rows = 2
        plain.__dict__.pop("_cpu_experts")
        assert moe_cpu.CpuExperts.of(plain).rows == 2
        assert moe_cpu.routed(plain, x, *plain.route(x)) is None
        assert moe_cpu.routed(plain, x[:2], *plain.route(x[:2])) is not None
        plain.experts[3].down_proj.bias = torch.nn.Parameter(torch.zeros(moe.gate.in_features).bfloat16())
        plain.__dict__.pop("_cpu_experts")
        assert moe_cpu.CpuExperts.of(plain) is None


def _int4_block(args, experts: int, k: int, gen: torch.Generator) -> SparseMoE:
    """A sparse block of the family's shape with ``experts`` int4 experts (random weights), ``k`` a row."""
    moe = SparseMoE(dataclasses.replace(args, num_experts=experts, experts_per_token=k))
    with torch.no_grad():
        for lin in moe.modules():
            if isinstance(lin, Linear):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.in_features**0.5)
    for e in moe.experts:
        e.gate_up_proj = quantize_linear(e.gate_up_proj, "int4", 32)
        e.down_proj = quantize_linear(e.down_proj, "int4", 32)
    return moe.eval()


def _picks(rows: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids ascending) of a step over 40 experts, 4 a row: expert 0 in every row, 1 and 2 in every
    other row, 3..9 and 10..38 spread, 39 in none (whatever the rows of a kernel call)."""
    ids = torch.tensor([[0, 1 + t % 2, 3 + t % 7, 10 + (5 * t) % 29] for t in range(rows)])
    weights = torch.softmax(torch.randn(rows, 4, generator=gen), dim=-1).to(dtype)
    return weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_steps_of_many_rows_take_the_grouped_kernel_bit_for_bit(loaded, dtype):
    gen = torch.Generator().manual_seed(3)
    moe = _int4_block(_blocks(loaded("float32", "int4"))[0].args, 40, 4, gen)
    ex = moe_cpu.CpuExperts.of(moe)
    assert ex is not None and ex.batched is not None
    one_call = ex.batched.rows
    assert one_call > 150  # a tiny block's step of 150 rows: one call unless cut below
    # past MAX_ROWS; 40: expert 0's rows in two chunks of the kernel; 150: past the former bound of 64 rows, in
    # one call and in calls of 64 rows (the last one 22)
    for rows, calls_of in (
        (9, one_call),
        (17, one_call),
        (32, one_call),
        (40, one_call),
        (150, one_call),
        (150, 64),
    ):
        x = torch.randn(rows, moe.gate.in_features, generator=gen).to(dtype)
        weights, ids = _picks(rows, dtype, gen)
        ex.batched.rows = calls_of
        try:
            fast = moe_cpu.routed(moe, x, weights, ids)
        finally:
            ex.batched.rows = one_call
        if dtype not in ex.batched.dtypes:  # bf16 where the experts' layers take AMX tiles: the loop's
            assert fast is None
            continue
        moe.route = lambda x, w=weights, i=ids: (w, i)  # the reference routes the same step
        try:
            assert fast is not None and fast.dtype == dtype
            assert torch.equal(fast, _reference(moe, x)), (rows, calls_of)
        finally:
            del moe.route
    x = torch.randn(int4_gemv.MAX_ROWS + 1, moe.gate.in_features, generator=gen).to(dtype)
    assert moe_cpu.routed(moe, x, *_picks(x.shape[0], dtype, gen)) is None  # past its bound: the loop's


def test_self_check_keeps_the_loop_for_many_rows_where_the_grouped_kernel_differs(loaded):
    gen = torch.Generator().manual_seed(4)
    moe = _int4_block(_blocks(loaded("float32", "int4"))[0].args, 40, 4, gen)
    assert moe_cpu.self_check([moe], torch.float32) == 1
    ex = moe_cpu.CpuExperts.of(moe)
    assert torch.float32 in ex.batched.dtypes
    real, flipped = ex.batched.fn, ex.tables[0].flip(0)

    def wrong(args):  # each expert's gate/up read from another's
        args.gate_up = flipped.data_ptr()
        return real(args)

    ex.batched.fn = wrong
    assert moe_cpu.self_check([moe], torch.float32) == 1  # steps of few rows keep their kernel
    assert ex.batched.dtypes == ()
    x = torch.randn(12, moe.gate.in_features, generator=gen)
    assert moe_cpu.routed(moe, x, *_picks(12, torch.float32, gen)) is None
    assert moe_cpu.routed(moe, x[:3], *_picks(3, torch.float32, gen)) is not None
    assert torch.equal(moe(x), _reference(moe, x))


def test_greedy_batch_of_many_sequences_equal_with_and_without_the_grouped_kernel(loaded, monkeypatch):
    llm = loaded("float32", "int4")
    ran = []
    real = moe_int4_batched.kernel
    monkeypatch.setattr(moe_int4_batched, "kernel", lambda *a: ran.append(a[1]) or real(*a))
    prompts = [[5 + (13 * i + 7 * j) % 800 for j in range(3 + i % 5)] for i in range(12)]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert len(prompts) > moe_cpu.MAX_ROWS and len(prompts) in ran, ran  # decode steps of all twelve rows
    assert got == _loop_tokens(llm, prompts)
    assert sum(len(set(o)) > 2 for o in got) >= 6, got


def test_greedy_long_prompts_equal_with_and_without_the_grouped_kernel(loaded, monkeypatch):
    """Prefill chunks past the former bound of 64 rows run in the grouped kernel, in several calls each, and give
    the per-expert loop's tokens."""
    llm = loaded("float32", "int4")
    ran, real = [], moe_int4_batched.kernel

    def spy(batched, rows, dtype):  # the steps the grouped kernel takes
        got = real(batched, rows, dtype)
        ran.extend([rows] if got is not None else [])
        return got

    monkeypatch.setattr(moe_int4_batched, "kernel", spy)
    for moe in _blocks(llm):
        monkeypatch.setattr(moe_cpu.CpuExperts.of(moe).batched, "rows", 48)
    prompts = [[5 + (17 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([70, 131])]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert max(ran) > 64, ran  # a prefill step past 64 rows: in calls of 48
    assert got == _loop_tokens(llm, prompts)
    assert sum(len(set(o)) > 2 for o in got) >= 1, got
