"""CPU decode steps replayed from C (``model/kernels/replay.py``, ``engine/cpu_graphs.py``): a recorded step's
kernel calls replayed over new buffer contents give the eager step's bits; a step planned dry makes the same
calls and writes nothing; a step running a torch operator is refused; the engine plans every batch size when it
starts, and its replayed decoding equals its eager decoding token for token."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.cpu_graphs import _spans, linear_layouts
from sidecar.model.kernels.cpu import amx_gemm, cpu_build, int4_gemv, int8_gemv, norm_act, replay
from sidecar.model.kernels.cpu.matmul_args import MatmulArgs
from sidecar.model.linear import Linear

pytestmark = pytest.mark.skipif(
    replay.unavailable_reason() is not None, reason="replay needs the C kernels (a C compiler with OpenMP)"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_over_new_inputs_gives_the_eager_bits(dtype):
    g = torch.Generator().manual_seed(0)
    rows, dim = 3, 64
    h = torch.randn(rows, dim, generator=g).to(dtype)
    delta = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    bias = torch.randn(dim // 2, generator=g).to(dtype)

    def step():
        x, s = norm_act.add_rms_norm(h, delta, w, 1e-6)  # an argument struct, pointing into the arena
        y, _ = norm_act.add_rms_norm(x, s, w, 1e-5)
        a = norm_act.silu_mul(y)  # [rows, dim / 2]
        return norm_act.add_bias(a, bias)

    def eager_now():  # the step run eagerly (not recorded) over the current contents
        return step().clone()

    out, plan = replay.record(step)
    assert plan.num_ops == 4 and plan.names == ["sidecar_add_rms_norm"] * 2 + [
        "sidecar_silu_mul",
        "sidecar_add_bias",
    ]
    assert torch.equal(out, eager_now())
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    for _ in range(3):  # new contents, same addresses: the replay reads them then
        h.copy_(torch.randn(rows, dim, generator=g).to(dtype))
        delta.copy_(torch.randn(rows, dim, generator=g).to(dtype))
        bias.copy_(torch.randn(dim // 2, generator=g).to(dtype))
        assert plan.replay(arena)
        assert torch.equal(plan.output(arena), eager_now())


def test_a_tuple_result_replays_to_every_tensor_s_eager_bits():
    """A pipeline stage's step returns the stream it hands on, two tensors: both live in the arena, neither
    overwritten by the other's bytes, and a dry plan of it makes the recording's calls."""
    g = torch.Generator().manual_seed(1)
    h, delta = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    w = torch.randn(64, generator=g)

    def step():
        x, s = norm_act.add_rms_norm(h, delta, w, 1e-6)
        y, s2 = norm_act.add_rms_norm(x, s, w, 1e-5)
        return s2, y  # the residual and the layer's output: (h, delta) as a stage hands them on

    out, plan = replay.record(step)
    assert isinstance(out, tuple) and len(out) == 2
    _, dry = replay.record(step, dry=True)
    assert dry.same_calls(plan)
    arena = torch.full((plan.arena_bytes,), 0xFF, dtype=torch.uint8)
    for _ in range(2):
        h.copy_(torch.randn(3, 64, generator=g))
        eager = [t.clone() for t in step()]
        assert plan.replay(arena)
        got = plan.output(arena)
        assert isinstance(got, tuple) and all(map(torch.equal, got, eager))
    with pytest.raises(replay.Unreplayable, match="not a tensor or a tuple of tensors"):
        replay.record(lambda: (step()[0], 3))


def test_arena_shares_the_bytes_of_tensors_whose_uses_do_not_overlap():
    x = torch.randn(4, 256)
    w = torch.ones(256)

    def step():
        y = x
        for _ in range(12):  # each output is read by the next call only
            y, _ = norm_act.add_rms_norm(y, None, w, 1e-6)
        return y

    out, plan = replay.record(step)
    one = 4 * 256 * 4
    assert plan.num_ops == 12 and plan.arena_bytes <= 3 * one  # not 12 tensors' worth
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    x.copy_(torch.randn(4, 256))
    assert plan.replay(arena) and torch.equal(plan.output(arena), step())


def test_a_torch_operator_in_the_step_is_refused_by_name():
    x = torch.randn(2, 64)
    w = torch.ones(64)

    def step():
        y, _ = norm_act.add_rms_norm(x, None, w, 1e-6)
        return y * 2.0  # computes outside our kernels: a replay would skip it

    with pytest.raises(replay.Unreplayable, match="aten::mul"):
        replay.record(step)
    with pytest.raises(replay.Unreplayable, match="no kernel calls"):
        replay.record(lambda: torch.empty(3))


def test_a_step_planned_dry_makes_the_recorded_calls_and_writes_nothing():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    acc = torch.randn(3, 32, generator=g).to(
        torch.bfloat16
    )  # state the step adds to in place (as a KV write)
    bias = torch.randn(32, generator=g).to(torch.bfloat16)

    def step():
        y, _ = norm_act.add_rms_norm(h, None, w, 1e-6)
        norm_act.add_bias(acc, bias)
        return norm_act.silu_mul(y)

    before = acc.clone()
    out, dry = replay.record(step, dry=True)
    assert torch.equal(acc, before)  # no kernel ran
    assert dry.names == ["sidecar_add_rms_norm", "sidecar_add_bias", "sidecar_silu_mul"]
    want = step().clone()  # eagerly: acc + bias once
    acc.copy_(before)
    _, recorded = replay.record(step)
    assert dry.same_calls(recorded)
    acc.copy_(before)
    arena = torch.full((dry.arena_bytes,), 0xFF, dtype=torch.uint8)
    assert dry.replay(arena)
    assert torch.equal(dry.output(arena), want) and torch.equal(acc, before + bias)


def test_a_dry_pass_stops_at_a_torch_operator_before_it_runs():
    x = torch.ones(2, 64)
    w = torch.ones(64)

    def step():
        x.mul_(2.0)  # computes outside our kernels
        return norm_act.add_rms_norm(x, None, w, 1e-6)[0]

    with pytest.raises(replay.Unreplayable, match="aten::mul_"):
        replay.record(step, dry=True)
    assert torch.equal(x, torch.ones(2, 64))  # stopped before it ran on tensors no kernel had filled


def test_a_dry_pass_refuses_a_step_that_keeps_what_it_allocated():
    x = torch.randn(2, 64)
    w = torch.ones(64)
    kept = []

    def lazy_setup_step():  # state a kernel fills once and the step keeps: a dry pass would leave it unfilled
        if not kept:
            kept.append(norm_act.add_rms_norm(x, None, w, 1e-6)[0])
        return norm_act.add_rms_norm(kept[0], None, w, 1e-6)[0]

    with pytest.raises(replay.Unreplayable, match=r"\(2, 64\) tensor the step allocated is held after it"):
        replay.record(lazy_setup_step, dry=True)
    kept.clear()
    out, plan = replay.record(lazy_setup_step)  # recorded (run), it is filled
    assert plan.num_ops == 2 and torch.equal(out, norm_act.add_rms_norm(kept[0], None, w, 1e-6)[0])


def test_a_dry_pass_is_refused_where_torch_cannot_count_a_storage_s_holders(monkeypatch):
    x = torch.randn(2, 64)
    w = torch.ones(64)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    with pytest.raises(replay.Unreplayable, match="how many tensors hold a storage"):
        replay.record(lambda: norm_act.add_rms_norm(x, None, w, 1e-6)[0], dry=True)


def test_a_librarys_answers_about_itself_are_never_recorded():
    """A call without arguments (what a library was built with, what the CPU grants it) reads no step's buffers: a
    recording or a planning pass lets it answer as itself, where a recorded one replayed as a refusal (its nonzero
    answer) and a planned one answered 0."""
    seen = []
    lib = int4_gemv._KERNEL.lib()
    bits = lib.sidecar_int4_vector_bits()
    assert bits in (256, 512)
    cpu_build.set_recorder(lambda fn, args: seen.append(fn.name) or True)  # a planning pass: nothing is made
    try:
        assert lib.sidecar_int4_vector_bits() == bits
        x = torch.zeros(1, 64).bfloat16()
        w = torch.zeros(32, 32, dtype=torch.uint8)
        block_n, split = int4_gemv.torch_layout()
        lib.sidecar_int4_matmul(
            MatmulArgs(
                x=x.data_ptr(),
                w=w.data_ptr(),
                scales=torch.zeros(2, 32, 2).bfloat16().data_ptr(),
                y=torch.zeros(1, 32).data_ptr(),
                M=1,
                N=32,
                K=64,
                nthreads=1,
                x_bf16=1,
                group_size=32,
                block_n=block_n,
                split=split,
            )
        )
    finally:
        cpu_build.set_recorder(None)
    assert seen == ["sidecar_int4_matmul"]


def test_an_argument_struct_replays_over_any_arena_as_recorded():
    """A kernel taking an argument struct: the plan keeps a copy of it as it was at the call (the caller may reuse
    the struct), and its pointers into the step's tensors follow the arena wherever it lies."""
    g = torch.Generator().manual_seed(1)
    h, delta, w = (
        torch.randn(3, 64, generator=g),
        torch.randn(3, 64, generator=g),
        torch.randn(64, generator=g),
    )
    reused = []
    real = norm_act._KERNEL.lib().sidecar_add_rms_norm

    def reusing(args):  # the caller changes its struct after each call: the recording must not see that
        real.function(args)
        reused.append(args)
        args.eps, args.h = 0.5, 0

    def step():
        x, s = norm_act.add_rms_norm(h, delta, w, 1e-6)
        return norm_act.add_rms_norm(x, s, w, 1e-5)[0]

    expected = step().clone()
    lib = norm_act._KERNEL.lib()
    lib.sidecar_add_rms_norm = cpu_build.KernelFunction(real.function, real.name, real.argtypes, real.restype)
    lib.sidecar_add_rms_norm.function = reusing  # recorded as the kernel, called through ``reusing``
    try:
        out, plan = replay.record(step)
    finally:
        lib.sidecar_add_rms_norm = real
    assert torch.equal(out, expected) and len(reused) == 2 and reused[0].h is None
    for pad in (0, 4096):  # two arenas at different addresses
        arena = torch.full((plan.arena_bytes + pad,), 0xFF, dtype=torch.uint8)[pad:]
        assert plan.replay(arena)
        assert torch.equal(plan.output(arena), expected)


def test_spans_of_sizes():
    assert _spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8" and _spans([4]) == "4"


def test_a_kernel_refusing_at_replay_stops_it_and_is_named():
    x = torch.randn(2, 64)
    w = torch.ones(64)
    matmul = amx_gemm._KERNEL.lib().sidecar_amx_int4_matmul  # refuses no codes with 1, in every build

    def step():
        y, _ = norm_act.add_rms_norm(x, None, w, 1e-6)
        matmul(MatmulArgs(group_size=1))
        z, _ = norm_act.add_rms_norm(y, None, w, 1e-6)
        return z

    _, plan = replay.record(step)
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    assert not plan.replay(arena)
    assert plan.refused == "sidecar_amx_int4_matmul"
    with pytest.raises(ValueError, match="arena"):
        plan.replay(torch.empty(0, dtype=torch.uint8))


# ------------------------------------------------------------------ the engine


def _decode(llm: LLM, prompts, max_tokens):
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_engine_replays_decode_exactly_as_eager(demo_dir, quantization):
    kw = dict(
        model=str(demo_dir),
        dtype="bfloat16",
        quantization=quantization,
        block_size=8,
        num_kv_blocks=96,
        max_num_seqs=4,
        quant_group_size=64,
    )
    eager = LLM(enforce_eager=True, **kw)
    fast = LLM(**kw)
    assert eager.engine.model_info["cpu_decode_replay"] is False
    assert fast.engine.model_info["cpu_decode_replay"] is True, fast.engine.model_info[
        "cpu_decode_replay_reason"
    ]
    # how the linear layers hold their weights: every one counted once; bf16 ones in the tile layout where it runs
    # (under quantized weights none is left: the head is int8 by default)
    layouts = fast.engine.model_info["cpu_linear_layouts"]
    linears = [m for m in fast.engine.runner.model.modules() if isinstance(m, Linear)]
    assert sum(layouts.values()) == len(linears)
    assert (len(linears) > 0) is (quantization is None)
    if quantization is None and amx_gemm.available():
        assert layouts == {f"tile layout ({amx_gemm.path()})": len(linears)}
    plans = fast.engine.runner.cpu_plans
    # every size planned when the engine started, except where bf16 batches past our kernel's rows go to oneDNN
    # (where it has bf16 and AMX does not serve them): those are recorded at their first step, and refused
    assert fast.engine.model_info["cpu_decode_planned"] is True, fast.engine.model_info[
        "cpu_decode_planned_reason"
    ]
    assert 1 in plans.recorded and set(plans.recorded) <= {1, 2, 3, 4} and plans.arena_bytes > 0
    if quantization is not None or amx_gemm.available():
        assert plans.recorded == [1, 2, 3, 4]
    planned = list(plans.recorded)
    # different lengths: the batch shrinks 3 -> 2 -> 1 rows
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19]]
    lens = [9, 14, 20]
    assert _decode(fast, prompts, lens)[0] == _decode(eager, prompts, lens)[0]
    assert plans.enabled and {1, 2, 3} <= set(plans.recorded) | set(plans.eager_sizes)
    assert plans.recorded == planned and not set(plans.eager_sizes) & set(planned)
    assert all("outside our kernels" in why for why in plans.eager_sizes.values())
    # every step of these sizes is a replay now: still the same tokens, blocks returned
    assert _decode(fast, prompts, lens)[0] == _decode(eager, prompts, lens)[0]
    eng = fast.engine
    assert not eng.requests and eng.kv.num_free_blocks() == eng.kv.num_blocks


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_decode_batches_on_the_tile_path_over_codes_replay(demo_dir, quantization, monkeypatch):
    """Decode batches that take AMX's tile path over int8 / int4 codes (here from 2 rows; where AMX runs) are planned
    and replayed like every other size: the path asks the library nothing at a call that a recording would keep."""
    monkeypatch.setattr(int8_gemv, "TILE_MIN_ROWS", 2)
    monkeypatch.setattr(int4_gemv, "TILE_MIN_ROWS", 2)
    kw = dict(
        model=str(demo_dir),
        dtype="bfloat16",
        quantization=quantization,
        block_size=8,
        num_kv_blocks=96,
        max_num_seqs=4,
        quant_group_size=64,
    )
    eager = LLM(enforce_eager=True, **kw)
    fast = LLM(**kw)
    assert fast.engine.model_info["cpu_decode_replay"] is True, fast.engine.model_info[
        "cpu_decode_replay_reason"
    ]
    plans = fast.engine.runner.cpu_plans
    assert plans.recorded == [1, 2, 3, 4] and not plans.eager_sizes
    layers = [
        m._cpu_layer for m in fast.engine.runner.model.modules() if getattr(m, "_cpu_layer", None) is not None
    ]
    assert layers
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19]]
    lens = [9, 14, 20]
    assert _decode(fast, prompts, lens)[0] == _decode(eager, prompts, lens)[0]
    assert plans.recorded == [1, 2, 3, 4] and not plans.eager_sizes
    amx = amx_gemm.available() and amx_gemm.path() == "AMX"
    on_tiles = [
        (layer.from_rows == 2) if quantization == "int8" else (layer.tiles is not None) for layer in layers
    ]
    assert all(on_tiles) == (amx and (quantization == "int8" or int4_gemv.tiles_available())), (amx, on_tiles)


def test_float32_layers_outside_our_kernels_keep_steps_eager(demo_dir):
    # float32 layers run in oneDNN (a torch operator): the self-check names it and decoding stays eager
    llm = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=64)
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is False and "outside our kernels" in info["cpu_decode_replay_reason"]
    assert not any(
        kind.startswith("tile layout") for kind in info["cpu_linear_layouts"]
    )  # float32: not bf16's
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.engine.runner.cpu_plans.recorded == []


def test_self_check_keeps_replays_off_when_a_replay_differs(demo_dir, monkeypatch):
    llm = LLM(model=str(demo_dir), dtype="bfloat16", block_size=8, num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.cpu_plans.enabled
    monkeypatch.setattr(replay.Plan, "replay", lambda self, arena: True)  # runs nothing: the result unwritten
    assert "differs" in runner.cpu_plans.self_check()
    reason = runner.cpu_plans.reason
    assert runner.cpu_plans.info() == {
        "cpu_decode_replay": False,
        "cpu_decode_replay_reason": reason,
        "cpu_decode_planned": False,
        "cpu_decode_planned_reason": reason,
        "cpu_linear_layouts": linear_layouts(runner.model),
    }
    assert not runner.cpu_plans.replays() and runner.cpu_plans.recorded == []


def test_steps_planned_dry_unlike_their_recording_are_recorded_instead(demo_dir, monkeypatch):
    kw = dict(model=str(demo_dir), dtype="bfloat16", block_size=8, num_kv_blocks=96, max_num_seqs=4)
    prompts, lens = [[3, 4, 5, 6], [7, 8, 9], [10, 11]], [6, 10, 16]
    want = _decode(LLM(enforce_eager=True, **kw), prompts, lens)[0]
    monkeypatch.setattr(replay.Plan, "same_calls", lambda self, other: False)
    llm = LLM(**kw)
    plans = llm.engine.runner.cpu_plans
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is True and info["cpu_decode_planned"] is False
    assert "makes other calls than its recording" in info["cpu_decode_planned_reason"]
    assert plans.recorded == []  # nothing planned ahead: each size runs eagerly, then is recorded
    assert _decode(llm, prompts, lens)[0] == want
    assert 1 in plans.recorded and set(plans.recorded) | set(plans.eager_sizes) <= {1, 2, 3}


def test_planned_steps_replay_from_the_first_step(demo_dir, monkeypatch):
    from sidecar.engine import cpu_graphs

    kw = dict(
        model=str(demo_dir),
        dtype="bfloat16",
        block_size=8,
        num_kv_blocks=96,
        max_num_seqs=3,
        quantization="int8",
    )  # int8 layers: our kernels at every size on every CPU
    prompts, lens = [[3, 4, 5, 6], [7, 8, 9], [10, 11]], [6, 10, 16]
    want = _decode(LLM(enforce_eager=True, **kw), prompts, lens)[0]
    monkeypatch.setattr(cpu_graphs, "PLAN_AHEAD", 2)  # sizes past it: planned when first seen
    llm = LLM(**kw)
    plans = llm.engine.runner.cpu_plans
    assert plans.recorded == [1, 2]
    ran = {"replays": 0, "body": 0, "dry": 0, "recorded": 0}
    real_replay, real_body, real_record = replay.Plan.replay, type(plans).body, replay.record

    def counted_replay(self, arena):
        ran["replays"] += 1
        return real_replay(self, arena)

    def counted_body(self, bucket):
        ran["body"] += 1
        return real_body(self, bucket)

    def counted_record(step, dry=False):
        ran["dry" if dry else "recorded"] += 1
        return real_record(step, dry)

    monkeypatch.setattr(replay.Plan, "replay", counted_replay)
    monkeypatch.setattr(type(plans), "body", counted_body)
    monkeypatch.setattr(replay, "record", counted_record)
    assert _decode(llm, prompts, lens)[0] == want
    # every decode step (16 - 1 tokens after the prefill) a replay; the one pass of the step's Python was size 3's
    # dry pass, when first seen; nothing ran eagerly or was recorded
    assert ran == {"replays": 15, "body": 1, "dry": 1, "recorded": 0}
    assert plans.recorded == [1, 2, 3]


def test_a_replay_refused_while_serving_falls_back_to_eager(demo_dir, monkeypatch):
    kw = dict(model=str(demo_dir), dtype="bfloat16", block_size=8, num_kv_blocks=64)
    prompts, lens = [[3, 4, 5, 6], [7, 8]], [12, 6]
    want = _decode(LLM(enforce_eager=True, **kw), prompts, lens)[0]
    llm = LLM(**kw)
    calls = []
    real = replay.Plan.replay

    def refuse_third(self, arena):
        calls.append(1)
        return real(self, arena) and len(calls) < 3

    monkeypatch.setattr(replay.Plan, "replay", refuse_third)
    assert _decode(llm, prompts, lens)[0] == want  # the refused step ran eagerly
    plans = llm.engine.runner.cpu_plans
    assert not plans.enabled and "refused" in plans.reason and plans.recorded == []
    assert _decode(llm, prompts, lens)[0] == want


def test_only_the_recording_thread_is_recorded():
    import threading

    x = torch.randn(2, 64)
    w = torch.ones(64)
    others = []

    def other_thread():  # another engine's kernel calls while this thread records
        for _ in range(20):
            others.append(norm_act.add_rms_norm(x, None, w, 1e-6)[0])

    def step():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return norm_act.add_rms_norm(x, None, w, 1e-6)[0]

    _, plan = replay.record(step)
    assert len(others) == 20 and plan.num_ops == 1


def test_a_batch_size_running_a_torch_operator_stays_eager_alone(demo_dir, monkeypatch):
    kw = dict(model=str(demo_dir), dtype="bfloat16", block_size=8, num_kv_blocks=96, max_num_seqs=4)
    prompts, lens = [[3, 4, 5, 6], [7, 8, 9], [10, 11]], [6, 10, 16]
    kernel = norm_act.add_rms_norm
    # from 2 rows on, the norms through torch (as bf16 layers past our kernel's rows go to oneDNN on some CPUs)
    monkeypatch.setattr(
        norm_act,
        "add_rms_norm",
        lambda h, *a: kernel(h, *a) if h.shape[0] == 1 else norm_act.add_rms_norm_reference(h, *a),
    )
    want = _decode(LLM(enforce_eager=True, **kw), prompts, lens)[0]
    llm = LLM(**kw)
    plans = llm.engine.runner.cpu_plans
    assert plans.enabled, plans.reason  # one row records; the two-row check does not turn replays off
    assert _decode(llm, prompts, lens)[0] == want
    assert plans.recorded == [1] and set(plans.eager_sizes) == {2, 3}
    assert all("outside our kernels" in why for why in plans.eager_sizes.values())
