"""CPU decode replays on every rank of a tensor-parallel group (engine/tp_replay.py): the ranks' recorded
plans make their shared-memory all-reduces from C, and a replayed group gives the eager group's bits."""

from __future__ import annotations

import os
import signal
import time

import pytest

from sidecar import LLM, SamplingParams
from sidecar.model.kernels.cpu import replay, shm_allreduce
from tests.unit.engine.test_tensor_parallel import _pool_whole, _prompts

pytestmark = pytest.mark.skipif(
    not shm_allreduce.available() or replay.unavailable_reason() is not None,
    reason="no C compiler for the CPU kernels",
)


def _llm(demo_dir, **kw) -> LLM:
    return LLM(
        model=str(demo_dir),
        dtype="bfloat16",  # bf16 layers run in our kernels: a step a replay can make
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=16,  # 120 tokens for seven requests of up to 52: preemption
        max_num_batched_tokens=16,  # prompts arrive in chunks
        max_num_seqs=4,
        **kw,
    )


def test_replayed_group_matches_the_eager_group_bit_for_bit(demo_dir):
    eager = _llm(demo_dir, enforce_eager=True)
    try:
        prompts = _prompts(eager.engine.vocab_size)
        params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
        want = eager.generate(prompts, params)
        assert eager.engine.model_info["cpu_decode_replay"] is False
        assert eager.engine.runner.cpu_plans.reason == "enforce_eager"
    finally:
        eager.engine.tp.close()
    fast = _llm(demo_dir)
    try:
        tp = fast.engine.tp
        assert tp.comm.shm is not None  # the all-reduces a replay makes are the shared-memory kernel's
        assert tp.replay_checks == {0: None, 1: None}  # every rank's self-check passed: every rank replays
        info = fast.engine.model_info
        assert info["cpu_decode_replay"] is True, info["cpu_decode_replay_reason"]
        got = fast.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
        assert fast.stats()["num_preemptions"] > 0
        assert fast.engine.runner.cpu_plans.recorded  # the decode steps went through plans
        _pool_whole(fast)
        again = fast.generate(prompts[:2], params)  # after the preemptions and with the plans kept
        assert [o.token_ids for o in again] == [o.token_ids for o in want[:2]]
        _pool_whole(fast)
        _kill_worker_mid_replay(fast, prompts)
    finally:
        fast.engine.tp.close()
    assert not shm_allreduce.segment_exists(tp.shm_name)


def _kill_worker_mid_replay(llm: LLM, prompts) -> None:
    """A worker killed while the ranks replay: rank 0's replayed all-reduce fails (the peer's exit), the step's
    requests fail naming the rank, never a hang; the pool whole after."""
    eng = llm.engine
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in prompts[:2]]
    outs = {}
    steps = 0
    while not outs or steps < 3:  # through the prompts, then a few replayed decode steps
        steps += bool(outs)
        for o in eng.step():
            outs[o.request_id] = o
    (pid,) = eng.tp.pids().values()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine hung after its worker died"
        for o in eng.step():
            outs[o.request_id] = o
    for rid in ids:
        assert outs[rid].finish_reason == "abort"
        assert "TPWorkerLost: tensor-parallel worker rank 1" in outs[rid].abort_reason
    _pool_whole(llm)
