"""Tensor parallelism over gloo on CPU: two ranks give HF float32's greedy tokens, and faults end in errors."""

from __future__ import annotations

import dataclasses

import os
import random
import shutil
import signal
import sys
import time

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.tp import TPWorkerLost, wait_for_ranks
from sidecar.model.kernels.cpu import shm_allreduce
from sidecar.model.args import ModelArgs
from sidecar.model.tp_shard import Shard
from tests.unit.engine.test_engine_vs_hf import hf_generate

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _checkpoint(kind: str, out, tokenizer_dir):
    """Llama: one KV head for two ranks (replicated), untied head, biases on q/k/v/o and the MLP (row-parallel
    biases added once). Qwen2: two KV heads (one per rank), tied head, q/k/v biases."""
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        vocab_size=len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))),  # odd: the last shard pads
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(
            **common, num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
        )
        model = tf.LlamaForCausalLM
    else:
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM
    torch.manual_seed(1)
    hf = model(cfg).eval()
    hf.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out, hf


def _prompts(vocab: int):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(5)]
    shared = [rng.randrange(3, vocab) for _ in range(24)]  # three full 8-token blocks
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(k)] for k in (3, 5)]


def _pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not llm.engine.requests and not kv.req_blocks
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


@pytest.fixture(scope="module")
def engines(tmp_path_factory, demo_dir):
    """Per family: (LLM over two ranks with a tight pool and a small token budget, HF's greedy tokens)."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    try:
        for kind in ("llama", "qwen2"):
            path, hf = _checkpoint(kind, root / kind, demo_dir)
            prompts = _prompts(hf.config.vocab_size)
            llm = LLM(
                model=str(path),
                dtype="float32",
                tensor_parallel_size=2,
                block_size=8,
                num_kv_blocks=16,  # 120 tokens for seven requests of up to 48: preemption
                max_num_batched_tokens=16,  # prompts arrive in chunks
            )
            out[kind] = (llm, prompts, hf_generate(hf, prompts, MAX_NEW))
            out[f"{kind}_path"] = path
        yield out
    finally:
        for kind in ("llama", "qwen2"):
            if kind in out:
                out[kind][0].engine.tp.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_match_hf_with_preemption_chunks_and_prefix_hits(engines, kind):
    llm, prompts, ref = engines[kind]
    tp = llm.engine.tp
    # one host's CPU ranks sum through the shared-memory segment (engine/tp_shm.py), its name already gone
    assert tp.shm_reason is None and tp.comm.shm is not None
    assert not shm_allreduce.segment_exists(tp.shm_name)
    calls = tp.comm.shm_calls
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == ref
    assert tp.comm.shm_calls > calls
    assert llm.stats()["num_preemptions"] > 0
    _pool_whole(llm)
    # Again, one at a time: the shared 24-token prefix (and each prompt's own blocks) come from the cache.
    again = [llm.generate([p], GREEDY)[0] for p in prompts[-2:]]
    assert [o.token_ids for o in again] == ref[-2:]
    assert all(o.num_cached_tokens >= 24 for o in again)
    _pool_whole(llm)
    # No device path that only rank 0 would take; float32 layers run in oneDNN, which a CPU replay cannot
    # make: every rank's self-check says so, and every rank runs the eager step.
    assert set(llm.engine.model_info["fast_path_fallbacks"].values()) == {"tensor_parallel_size 2"}
    assert set(tp.replay_checks) == {0, 1} and all(
        "outside our kernels" in r for r in tp.replay_checks.values()
    )
    assert llm.engine.model_info["cpu_decode_replay"] is False
    assert "self-check failed on rank 0" in llm.engine.runner.cpu_plans.reason


def test_each_rank_runs_on_its_own_cpus(engines):
    """On a CPU host every rank's threads are pinned to its share of the CPUs (engine/cpu_bind.py)."""
    from sidecar.engine import cpu_bind

    allowed = cpu_bind.host_cpus()
    want = [cpu_bind.rank_cpus(2, r, allowed, cpu_bind.numa_nodes()) for r in (0, 1)]
    for kind in ("llama", "qwen2"):  # the second group's worker was spawned by a pinned rank 0
        got = [os.sched_getaffinity(0), os.sched_getaffinity(engines[kind][0].engine.tp.pids()[1])]
        assert got == ([set(w) for w in want] if want[0] is not None else [allowed, allowed])


def test_features_needing_rank0_state_are_refused(engines):
    llm = engines["qwen2"][0]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0))
    _pool_whole(llm)
    with pytest.raises(ValueError, match="speculative: a draft model is not supported with tensor_parallel"):
        EngineConfig(model="demo", tensor_parallel_size=2, speculative="draft:demo")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="demo", tensor_parallel_size=0)


def test_shapes_that_do_not_split_are_refused():
    args = ModelArgs.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
            "max_position_embeddings": 64,
        }
    )
    with pytest.raises(ValueError, match="tensor_parallel_size: .* 3 attention heads"):
        Shard(0, 2).local_args(args)
    assert Shard(1, 3).ranges(args)["q"] == (1, 2)
    hybrid = dataclasses.replace(args, num_heads=4, num_kv_heads=2, linear_layers=(0,))
    with pytest.raises(ValueError, match="tensor_parallel_size: .* linear-attention layers"):
        Shard(0, 2).local_args(hybrid)


def test_rank_that_never_joins_is_named():
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=sys.exit, args=(3,), daemon=True)
    dead.start()
    dead.join(30)
    with pytest.raises(RuntimeError, match=r"rank 2 \(pid \d+\) exited with code 3 before joining"):
        wait_for_ranks(store, {2: dead}, 30.0)
    store.set("joined/1", "1")
    slow = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    slow.start()
    try:
        with pytest.raises(RuntimeError, match=r"rank\(s\) 2 did not join"):
            wait_for_ranks(store, {1: slow, 2: slow}, 0.5)
    finally:
        slow.kill()
        slow.join()


def test_int4_weights_quantized_per_shard_match_one_process(engines, monkeypatch):
    """Each rank quantizes its own slices on load. int4 groups run along the input columns; with 32-column
    groups no group straddles the ranks' column split of o / down (64 of 128 columns each), so every rank holds
    exactly one process's codes and scales (the head is int8 per vocabulary row, also whole on its rank).
    Its all-reduces go over gloo (SIDECAR_TP_SHM=0): the same tokens."""
    monkeypatch.setenv("SIDECAR_TP_SHM", "0")
    _, prompts, _ = engines["llama"]
    params = dict(
        model=str(engines["llama_path"]),
        dtype="float32",
        quantization="int4",
        quant_group_size=32,
        num_kv_blocks=32,
    )
    one = LLM(**params).generate(prompts[:3], GREEDY)
    split = LLM(**params, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in split.generate(prompts[:3], GREEDY)] == [o.token_ids for o in one]
        assert split.engine.model_info["quantization"] == "int4"
        assert split.engine.tp.comm.shm is None and "SIDECAR_TP_SHM=0" in split.engine.tp.shm_reason
        _pool_whole(split)
    finally:
        split.engine.tp.close()


def test_killed_worker_fails_requests_instead_of_hanging(engines):
    """Last in this module: it breaks the llama engine's group for good."""
    llm, prompts, _ = engines["llama"]
    eng = llm.engine
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:3]]
    outs = {}
    for _ in range(4):
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
        assert outs[rid].finished and outs[rid].finish_reason == "abort"
        assert "TPWorkerLost: tensor-parallel worker rank 1" in outs[rid].abort_reason
        assert "exited with code -9" in outs[rid].abort_reason
    assert eng.tp.broken
    assert not shm_allreduce.segment_exists(eng.tp.shm_name)
    _pool_whole(llm)
    later = llm.generate([prompts[0]], GREEDY)[0]  # fails at once, naming the lost rank
    assert later.finish_reason == "abort" and "rank 1" in later.abort_reason
    _pool_whole(llm)
    with pytest.raises(TPWorkerLost):
        eng.runner.model(torch.tensor([1]), torch.tensor([0]), eng.runner.kv_caches, None)


def test_stopped_worker_is_ended_by_its_heartbeat(engines):
    """A worker that stops (SIGSTOP: alive, silent) while rank 0 waits for it in the shared-memory all-reduce
    is ended by rank 0's watchdog once its heartbeat is stale, and the wait ends with the peer's exit, well
    before the collective timeout; the requests fail naming it. Last use of the qwen2 engine."""
    llm, prompts, _ = engines["qwen2"]
    eng = llm.engine
    assert eng.tp.comm.shm is not None
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:2]]
    outs = {o.request_id: o for o in eng.step()}
    (pid,) = eng.tp.pids().values()
    os.kill(pid, signal.SIGSTOP)
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    for rid in ids:
        assert outs[rid].finish_reason == "abort"
        assert "tensor-parallel worker rank 1" in outs[rid].abort_reason
        assert "after its heartbeat stopped for" in outs[rid].abort_reason
    assert eng.tp.watchdog.hung.keys() == {1}
    _pool_whole(llm)
