"""Overlapped decode steps (engine/overlap.py) on CPU, forced on: launch order, stops at every position
relative to the pipeline, aborts / deadlines / preemption between launch and readback, resources, and
outputs equal to the synchronous engine and to HF greedy."""

from __future__ import annotations

import time

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine import sampler as sampler_mod
from sidecar.engine.engine import LLMEngine
from tests.unit.engine.test_engine import drain
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts

MAX_NEW = 10


def _llm(model_dir, overlap: bool, **kw) -> LLM:
    kw.setdefault("block_size", 8)
    return LLM(model=str(model_dir), dtype="float32", overlap_steps=overlap, **kw)


@pytest.fixture(scope="module")
def demo_pair(demo_dir):
    return _llm(demo_dir, False, num_kv_blocks=64), _llm(demo_dir, True, num_kv_blocks=64)


def _summary(outs):
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


def _pool_whole(llm: LLM) -> None:
    assert_pool_whole(llm)
    assert llm.engine.overlap.inflight is None
    assert llm.engine.sampler.tensors.slots_in_use() == 0


def test_overlap_defaults_off_on_cpu_and_validates(demo_pair, demo_dir):
    assert demo_pair[0].engine.overlap.enabled is False and demo_pair[1].engine.overlap.enabled is True
    assert LLM(model=str(demo_dir), dtype="float32", num_kv_blocks=16).engine.overlap.enabled is False
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(model=str(demo_dir), overlap_steps="yes")


def test_next_step_launches_from_device_ids_before_the_readback(demo_pair, monkeypatch):
    plain, llm = demo_pair
    eng = llm.engine
    events = []
    launch, decode_rows = eng.runner.launch_decode, eng.runner.decode_rows
    monkeypatch.setattr(
        eng.runner,
        "launch_decode",
        lambda reqs, kv, prev=None, src=None: (
            events.append(("launch", prev is not None)),
            launch(reqs, kv, prev, src),
        )[1],
    )
    gathered = []

    def rows_spy(rows, sample, prev_ids=None):
        if prev_ids is not None:  # every row's token is an index into the previous step's device ids
            gathered.append(all(0 <= r.token < len(prev_ids) for r in rows))
        return decode_rows(rows, sample, prev_ids)

    monkeypatch.setattr(eng.runner, "decode_rows", rows_spy)
    result = sampler_mod.PendingSample.result
    monkeypatch.setattr(
        sampler_mod.PendingSample, "result", lambda self: (events.append(("read",)), result(self))[1]
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 4, 7)]
    got = llm.generate(prompts, params)
    mine = list(events)  # the overlapped engine's only
    assert _summary(got) == _summary(plain.generate(prompts, params))
    events = mine
    # First launch from the scheduler (host ids), then: launch N from N-1's device ids, read N-1, ...
    launches = [e for e in events if e[0] == "launch"]
    assert launches[0] == ("launch", False) and all(e == ("launch", True) for e in launches[1:])
    assert len(launches) >= 5 and gathered and all(gathered)
    # the prompt step is synchronous; then each readback but the last follows the next step's launch
    assert events[:4] == [("read",), ("launch", False), ("launch", True), ("read",)]
    assert events[-3:] == [("launch", True), ("read",), ("read",)]  # read N-1, then the drain reads N
    assert all(events[i - 1][0] == "launch" for i, e in enumerate(events[:-1]) if e == ("read",) and i > 0)
    _pool_whole(llm)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_overlap_equals_plain_and_hf(tiny_models, kind):
    prompts = make_prompts(6, 900, 3, 40, seed=5)
    ref = hf_greedy(tiny_models[kind], prompts, MAX_NEW)
    lens = [MAX_NEW - i for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    outs = {}
    for overlap in (False, True):
        llm = _llm(tiny_models[kind], overlap, block_size=16)
        eng = llm.engine
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts[:3], params[:3])]
        for _ in range(3):  # later arrivals drain the pipeline to be admitted
            eng.step()
        ids += [eng.add_request(None, p, sp) for p, sp in zip(prompts[3:], params[3:])]
        done = drain(eng)
        outs[overlap] = [(done[i].token_ids, done[i].finish_reason) for i in ids]
        _pool_whole(llm)
    assert outs[True] == outs[False] == [(r[:n], "length") for r, n in zip(ref, lens)]


def _reference_tokens(plain: LLM, prompts, n=8):
    return [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_stop_tokens_eos_and_max_tokens_at_every_position(demo_pair, monkeypatch):
    plain, llm = demo_pair
    computed = []  # at finish: every token but the last computed, never a discarded in-flight row counted
    finish = LLMEngine._finish
    monkeypatch.setattr(
        LLMEngine,
        "_finish",
        lambda self, req, *a: (
            computed.append(req.num_computed_tokens == req.num_tokens - 1),
            finish(self, req, *a),
        )[1],
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    toks = _reference_tokens(plain, prompts)
    for j in range(8):  # the stop lands on every step of the pipeline, for each request at another one
        params = [
            SamplingParams(max_tokens=8, stop_token_ids=[t[(j + i) % 8]], ignore_eos=True)
            for i, t in enumerate(toks)
        ]
        assert _summary(llm.generate(prompts, params)) == _summary(plain.generate(prompts, params))
        lens = [SamplingParams(max_tokens=1 + (j + i) % 8, ignore_eos=True) for i in range(3)]
        assert _summary(llm.generate(prompts, lens)) == _summary(plain.generate(prompts, lens))
        _pool_whole(llm)
    saved = (plain.engine.eos_token_ids, llm.engine.eos_token_ids)
    try:
        for j in range(8):
            for e in (plain.engine, llm.engine):
                e.eos_token_ids = (toks[0][j],)
            sp = SamplingParams(max_tokens=8)
            out = llm.generate(prompts, sp)
            assert _summary(out) == _summary(plain.generate(prompts, sp)) and out[0].finish_reason == "stop"
            _pool_whole(llm)
    finally:
        plain.engine.eos_token_ids, llm.engine.eos_token_ids = saved
    assert len(computed) > 100 and all(computed)


def test_stop_strings_at_every_position(demo_pair):
    plain, llm = demo_pair
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    full = plain.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for o in full:
        text = o.text
        for end in range(1, len(text) + 1):
            stop = text[max(0, end - 2) : end]
            sp = SamplingParams(max_tokens=8, stop=[stop], ignore_eos=True)
            assert _summary(llm.generate(prompts, sp)) == _summary(plain.generate(prompts, sp))
    _pool_whole(llm)


def test_seeded_sampling_penalties_and_logprobs_equal_plain(demo_pair):
    plain, llm = demo_pair
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = [
        SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=7,
            temperature=1.1,
            top_p=0.9,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            seed=4,
            logprobs=2,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=8, repetition_penalty=1.4, min_p=0.1, logprobs=1, ignore_eos=True),
    ]
    got, ref = llm.generate(prompts, params), plain.generate(prompts, params)
    assert _summary(got) == _summary(ref)
    for g, r in zip(got, ref):
        assert (g.logprobs is None) == (r.logprobs is None)
        for a, b in zip(g.logprobs or [], r.logprobs or []):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    _pool_whole(llm)


def _until_in_flight(eng: LLMEngine, steps: int) -> None:
    for _ in range(steps):
        eng.step()
    assert eng.overlap.inflight is not None


def test_abort_and_deadline_between_launch_and_readback(demo_pair):
    plain, llm = demo_pair
    eng = llm.engine
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    ref = _reference_tokens(plain, prompts, MAX_NEW)
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts]
    emitted = {i: [] for i in ids}
    for _ in range(4):
        for o in eng.step():
            emitted[o.request_id] = o.token_ids
    assert eng.overlap.inflight is not None
    eng.abort(ids[0])  # its in-flight row is never read
    eng.requests[ids[1]].deadline = time.monotonic() - 1  # expires at the next step, also in flight
    done = drain(eng)
    assert done[ids[0]].finish_reason == "abort" and done[ids[0]].token_ids == emitted[ids[0]]
    assert done[ids[1]].abort_reason == "deadline" and done[ids[1]].token_ids == emitted[ids[1]]
    assert (
        emitted[ids[0]] == ref[0][: len(emitted[ids[0]])]
        and emitted[ids[1]] == ref[1][: len(emitted[ids[1]])]
    )
    assert done[ids[2]].token_ids == ref[2]
    _pool_whole(llm)


def test_preemption_between_launch_and_readback(demo_pair):
    plain, llm = demo_pair
    eng = llm.engine
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ref = _reference_tokens(plain, prompts, MAX_NEW)
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in prompts]
    _until_in_flight(eng, 4)
    victim = eng.requests[ids[1]]
    eng.scheduler._preempt(victim)  # as the scheduler would under pool pressure: its in-flight row is dropped
    done = drain(eng)
    assert [done[i].token_ids for i in ids] == ref and victim.num_preemptions == 1
    _pool_whole(llm)


def test_pool_pressure_preempts_in_the_synchronous_step(demo_dir):
    prompts = make_prompts(6, 200, 10, 20, seed=2)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        llm = _llm(demo_dir, overlap, num_kv_blocks=14, block_size=8)
        outs[overlap] = _summary(llm.generate(prompts, sp))
        assert llm.engine.scheduler.num_preemptions > 0
        _pool_whole(llm)
    assert outs[True] == outs[False]


def test_failed_overlapped_step_fails_its_requests(demo_dir, monkeypatch):
    llm = _llm(demo_dir, True, num_kv_blocks=32)
    eng = llm.engine
    ids = [
        eng.add_request(None, p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in ([5, 6], [7, 8, 9])
    ]
    _until_in_flight(eng, 2)
    launch = eng.runner.launch_decode
    monkeypatch.setattr(
        eng.runner, "launch_decode", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    )
    done = drain(eng)
    assert all(done[i].finish_reason == "abort" and "device lost" in done[i].abort_reason for i in ids)
    monkeypatch.setattr(eng.runner, "launch_decode", launch)
    _pool_whole(llm)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].finish_reason == "length"


def test_structured_rows_run_the_plain_step(demo_pair):
    plain, llm = demo_pair
    sp = SamplingParams(max_tokens=6, structured=["yes", "no"])
    trace = llm.engine.overlap.trace = []
    try:
        assert _summary(llm.generate([[5, 6, 7]], sp)) == _summary(plain.generate([[5, 6, 7]], sp))
    finally:
        llm.engine.overlap.trace = None
    assert trace == []
    _pool_whole(llm)


def test_cuda_engine_without_device_sampler_samples_on_cpu():
    from types import SimpleNamespace

    from sidecar.model.kernels.gpu_paths import FastPaths

    fp = FastPaths(reasons={"device_sampler": "seeded draw differs"})
    eng = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda", 0), fast_paths=fp))
    assert LLMEngine._sampling_device(eng) == torch.device("cpu")
    fp.device_sampler = True
    assert LLMEngine._sampling_device(eng) == torch.device("cuda", 0)
    eng.runner.device = torch.device("cpu")
    fp.device_sampler = False
    assert LLMEngine._sampling_device(eng) == torch.device("cpu")


# -- the device sampler under the start-up self-check ---------------------------------------------------
def test_sampler_check_agrees_on_cpu_and_catches_a_skewed_sampler(monkeypatch):
    from sidecar.engine import sampler_check

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 4
    assert sampler_check.compare(torch.device("cpu"), 0, logits) is None
    made = []

    class Skewed(sampler_mod.Sampler):  # the first sampler made (the "device" one) favours token 7
        def sample(self, x, reqs, masks=None, salt=0):
            if self is made[0]:
                x[:, 7] += 3.0
            return super().sample(x, reqs, masks)

        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)

    monkeypatch.setattr(sampler_check, "Sampler", Skewed)
    reason = sampler_check.compare(torch.device("cpu"), 0, logits)
    assert reason is not None and "differs from the CPU reference" in reason


def test_engine_self_check_turns_the_device_sampler_on_or_off_with_a_reason(demo_pair, monkeypatch):
    plain, llm = demo_pair
    runner = llm.engine.runner
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=9, ignore_eos=True),
    ]
    ref = _summary(plain.generate(prompts, params))
    try:
        runner.prepare_fast_paths(force_check=True)  # the engine gave the runner its sampler check
        assert "device_sampler" in runner.fast_paths.active()
        assert _summary(llm.generate(prompts, params)) == ref

        def broken_draw(self, logits, step, salt):
            raise RuntimeError("draw kernel failed")

        monkeypatch.setattr(sampler_mod.Sampler, "_draw", broken_draw)
        runner.prepare_fast_paths(force_check=True)
        assert (
            runner.fast_path_info()["fast_path_fallbacks"]["device_sampler"]
            == "RuntimeError: draw kernel failed"
        )
        assert "device_sampler" not in runner.fast_paths.active()
        monkeypatch.undo()
        assert _summary(llm.generate(prompts, params)) == ref  # the engine still samples right
    finally:
        runner.prepare_fast_paths()  # back to the CPU default
    _pool_whole(llm)


def test_full_batch_keeps_overlapping_with_a_backlog(demo_dir):
    """At max_num_seqs a waiting request cannot be admitted anyway: the pipeline goes on, and each admission
    (when a request finishes) drains it; outputs equal the synchronous engine's."""
    prompts = make_prompts(5, 200, 3, 12, seed=4)
    params = [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True) for i in range(5)]
    outs = {}
    for overlap in (False, True):
        llm = _llm(demo_dir, overlap, num_kv_blocks=64, max_num_seqs=2)
        trace = llm.engine.overlap.trace = []
        waiting_at_launch = []
        launch = llm.engine.overlap._launch_next

        def spy(p, eng=llm.engine, launch=launch):
            nxt = launch(p)
            waiting_at_launch.append(nxt is not None and bool(eng.scheduler.waiting))
            return nxt

        llm.engine.overlap._launch_next = spy
        outs[overlap] = _summary(llm.generate(prompts, params))
        _pool_whole(llm)
    assert outs[True] == outs[False]
    assert any(waiting_at_launch) and sum(e[0] == "launch" for e in trace) > 5
