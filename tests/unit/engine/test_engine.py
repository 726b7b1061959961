"""Engine behaviour on the demo model: validation, finishing, aborts, deadlines, limits, resources."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.async_engine import AsyncEngine
from sidecar.engine.engine import LLMEngine
from sidecar.engine.request import QueueFullError
from sidecar.engine.structured import Constraint


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_waiting_requests=8)


def pool_whole(engine: LLMEngine) -> bool:
    return (
        not engine.requests
        and engine.kv.num_free_blocks() == engine.kv.num_blocks
        and all(b.ref_cnt == 0 for b in engine.kv.pool.blocks[1:])
        and engine.sampler.tensors.slots_in_use() == 0
    )


def drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**6], SamplingParams(), "prompt"),
        ("x " * 600, SamplingParams(), "prompt"),  # longer than the 504-token pool
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_input_raises_value_error_naming_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(None, prompt, params)
    assert pool_whole(llm.engine)


def test_sampling_params_are_validated_once_and_immutable(llm):
    p = SamplingParams(stop="x", structured=["yes", "no"])
    assert p.stop == ["x"] and p.structured == Constraint("choice", ["yes", "no"])  # normalized once
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = -1.0  # a queued request's parameters cannot change under it
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)  # a changed copy is validated again
    with pytest.raises(ValueError, match="stop_token_ids"):  # the model's vocabulary is checked on add
        llm.engine.add_request(None, "hello", SamplingParams(stop_token_ids=[llm.engine.vocab_size]))
    assert not llm.engine.requests


def test_duplicate_request_id_rejected(llm):
    eng = llm.engine
    eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    drain(eng)
    assert pool_whole(eng)


def test_unknown_model_path_names_model():
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/model/dir")


def test_error_in_one_request_does_not_stop_others(llm):
    eng = llm.engine
    eng.add_request("good", "hello there", SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError):
        eng.add_request("bad", "", SamplingParams())
    done = drain(eng)
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 5
    assert pool_whole(eng)


def test_max_tokens_and_eos(llm):
    out = llm.generate(["hello"], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    eos = llm.engine.eos_token_ids[0]
    # Make the first generated token the stop token: it ends the request and its text is not returned.
    first = out.token_ids[0]
    stopped = llm.generate(["hello"], SamplingParams(max_tokens=7, stop_token_ids=[first]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == [first] and stopped.text == ""
    assert eos in llm.engine.eos_token_ids
    assert pool_whole(llm.engine)


def test_stop_string_finishes_and_is_removed(llm):
    full = llm.generate(["The cache"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(["The cache"], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert pool_whole(llm.engine)


def test_abort_frees_blocks_and_reports_abort(llm):
    eng = llm.engine
    eng.add_request("a1", "a long running request", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("a2", "another one", SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv.num_free_blocks() < eng.kv.num_blocks
    eng.abort("a1")
    done = drain(eng)
    assert done["a1"].finish_reason == "abort" and done["a1"].abort_reason == "client"
    assert done["a2"].finish_reason == "length"
    assert pool_whole(eng)


def test_deadline_expires_request(llm):
    eng = llm.engine
    eng.add_request(
        "late",
        "hello",
        SamplingParams(max_tokens=10_000 // 40, ignore_eos=True),
        deadline=time.monotonic() + 0.05,
    )
    done = drain(eng)
    assert done["late"].finish_reason == "abort" and done["late"].abort_reason == "deadline"
    assert pool_whole(eng)


def test_waiting_queue_is_bounded(llm):
    eng = llm.engine
    for i in range(8):
        eng.add_request(f"q{i}", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request("q8", "hello", SamplingParams(max_tokens=2))
    drain(eng)
    assert pool_whole(eng)


def test_priority_orders_admission(demo_dir):
    eng = LLMEngine(EngineConfig(model=str(demo_dir), max_num_seqs=1, num_kv_blocks=64))
    eng.add_request("low", "hello", SamplingParams(max_tokens=3), priority=5)
    eng.add_request("high", "hello", SamplingParams(max_tokens=3), priority=-1)
    order = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["high", "low"]


def test_max_num_seqs_bounds_the_batch(demo_dir):
    eng = LLMEngine(EngineConfig(model=str(demo_dir), max_num_seqs=2, num_kv_blocks=64))
    for i in range(5):
        eng.add_request(f"s{i}", "hello", SamplingParams(max_tokens=4, ignore_eos=True))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, len(eng.scheduler.running))
    assert peak == 2
    assert pool_whole(eng)


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate(["tell me a story"], p)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.9, ignore_eos=True) for n in (3, 20, 9)]
    mixed = llm.generate(["tell me a story", "x", "another prompt here", "y z"], [p] + others)[0].token_ids
    assert alone == mixed
    assert pool_whole(llm.engine)


def test_penalty_slots_are_returned_on_finish_and_abort(llm):
    eng = llm.engine
    pen = SamplingParams(
        max_tokens=30, temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True
    )
    for i in range(3):
        eng.add_request(
            f"pen{i}",
            "penalised prompt",
            pen if i else SamplingParams(max_tokens=3, repetition_penalty=1.2, ignore_eos=True),
        )
    for _ in range(6):
        eng.step()
    assert eng.sampler.tensors.slots_in_use() == 2  # pen0 finished (3 tokens) and gave its slot back
    eng.abort("pen1")
    eng.step()
    assert eng.sampler.tensors.slots_in_use() == 1
    drain(eng)
    assert pool_whole(eng)


def test_every_sampling_option_runs_through_the_engine(llm):
    p = SamplingParams(
        max_tokens=6,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        logprobs=2,
        ignore_eos=True,
    )
    out = llm.generate(["penalties and filters"], p)[0]
    assert len(out.token_ids) == 6 and len(out.logprobs) == 6
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 2 for lp in out.logprobs)
    greedy = llm.generate(
        ["penalties and filters"], SamplingParams(max_tokens=6, repetition_penalty=1.5, ignore_eos=True)
    )[0]
    plain = llm.generate(["penalties and filters"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(set(greedy.token_ids)) >= len(set(plain.token_ids))
    assert pool_whole(llm.engine)


def test_chat_applies_template(llm):
    ids = llm.engine.encode_chat([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = llm.chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=3, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        llm.chat([{"role": "robot", "content": "x"}])


def test_async_engine_streams_and_cancel_frees_blocks(demo_dir):
    async def main():
        ae = AsyncEngine.from_config(EngineConfig(model=str(demo_dir), num_kv_blocks=64))
        ae.start()
        try:
            full = None
            deltas = []
            async for o in ae.generate("hello", SamplingParams(max_tokens=12, ignore_eos=True)):
                deltas.append(o.delta_text)
                full = o
            assert full.finished and "".join(deltas) == full.text

            agen = ae.generate("cancel me", SamplingParams(max_tokens=500, ignore_eos=True))
            n = 0
            async for _ in agen:
                n += 1
                if n == 3:
                    break
            await agen.aclose()
            for _ in range(200):
                s = ae.stats()
                if s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            s = ae.stats()
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == 0

            with pytest.raises(ValueError, match="prompt"):
                async for _ in ae.generate("", SamplingParams()):
                    pass
        finally:
            await ae.shutdown(1.0)
        assert not ae.is_running

    asyncio.run(main())


def test_async_engine_tokenizes_on_its_own_tokenizer_from_any_thread(demo_dir):
    """Worker threads tokenize through AsyncEngine, never on the tokenizer the engine thread decodes with,
    and get exactly the engine's token ids."""
    eng = LLMEngine(EngineConfig(model=str(demo_dir), num_kv_blocks=64))
    ae = AsyncEngine(eng)
    assert ae._tokenizer is not eng.tokenizer
    msgs = [{"role": "user", "content": "hi <|im_start|>system"}]
    assert ae.encode_chat(msgs) == eng.encode_chat(msgs)
    texts = [f"text number {i} with some words" for i in range(40)]
    want = [eng.tokenize(t)[1] for t in texts]
    got: dict[int, list[int]] = {}

    def work(i: int) -> None:
        got[i] = ae.tokenize(texts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(texts))] == want
    assert ae.token_strings(want[0]) == [eng.tokenizer.decode([i]) for i in want[0]]
    info = ae.model_info
    info["max_model_len"] = -1  # a copy: callers cannot change the engine's facts
    assert ae.model_info["max_model_len"] == eng.max_model_len
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        ae.encode_chat([{"role": "robot", "content": "x"}])


def test_failing_step_fails_its_requests_not_the_engine(demo_dir, monkeypatch):
    eng = LLMEngine(EngineConfig(model=str(demo_dir), num_kv_blocks=64))
    eng.add_request("boom", "hello", SamplingParams(max_tokens=4, ignore_eos=True))

    def broken(*args, **kwargs):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(eng.sampler, "sample", broken)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("boom", "abort")]
    assert outs[0].abort_reason.startswith("error: RuntimeError")
    assert pool_whole(eng)
    monkeypatch.undo()
    eng.add_request("ok", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
    done = drain(eng)
    assert done["ok"].finish_reason == "length"
    assert pool_whole(eng)


def test_demo_model_built_once_under_concurrent_starts(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "demo"
    code = (
        "import sys; from sidecar.model.demo import ensure_demo_model; print(ensure_demo_model(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    assert {r[0].decode().strip() for r in results} == {str(target)}
    assert (target / "config.json").exists() and (target / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-build-")]
