"""Pipeline parallelism over gloo on CPU: two stages give HF float32's greedy tokens (odd and even layer
counts; mixtures of experts and latent attention too), each stage holds its own layers' pool and reads only
the tables it uses, and a lost stage ends in errors, not a hang."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time

import pytest

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.args import ModelArgs
from sidecar.model.pp_stage import Stage, stage_layers
from tests.unit.engine.test_engine_vs_hf import hf_generate

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _checkpoint(kind: str, layers: int, out, tokenizer_dir):
    """Llama: 3 layers (stage 0 holds one, stage 1 two), GQA, untied head, biases. Qwen2: 2 layers, tied head
    (the last stage's head reads the embedding's table), q/k/v biases."""
    import torch
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        vocab_size=len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))),
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
        model = tf.LlamaForCausalLM
    else:
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM
    torch.manual_seed(2)
    hf = model(cfg).eval()
    hf.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out, hf


def _prompts(vocab: int):
    rng = random.Random(5)
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
    root = tmp_path_factory.mktemp("pp")
    out = {}
    try:
        for kind, layers in (("llama", 3), ("qwen2", 2)):
            path, hf = _checkpoint(kind, layers, root / kind, demo_dir)
            prompts = _prompts(hf.config.vocab_size)
            llm = LLM(
                model=str(path),
                dtype="float32",
                pipeline_parallel_size=2,
                block_size=8,
                num_kv_blocks=16,  # 120 tokens for seven requests of up to 48: preemption
                max_num_batched_tokens=16,  # prompts arrive in chunks
            )
            out[kind] = (llm, prompts, hf_generate(hf, prompts, MAX_NEW))
        yield out
    finally:
        for kind in ("llama", "qwen2"):
            if kind in out:
                out[kind][0].engine.tp.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_stages_match_hf_with_preemption_chunks_and_prefix_hits(engines, kind):
    llm, prompts, ref = engines[kind]
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == ref
    assert llm.stats()["num_preemptions"] > 0
    _pool_whole(llm)
    again = [llm.generate([p], GREEDY)[0] for p in prompts[-2:]]
    assert [o.token_ids for o in again] == ref[-2:]
    assert all(o.num_cached_tokens >= 24 for o in again)
    _pool_whole(llm)
    # Rank 0's pool holds its own stage's layers only: the first of three, or of two.
    assert len(llm.engine.runner.kv_caches) == 1
    assert llm.engine.runner.cpu_plans.reason == "pipeline_parallel_size 2"


def test_stage_split_and_refusals():
    assert [list(stage_layers(3, 2, s)) for s in (0, 1)] == [[0], [1, 2]]
    assert [list(stage_layers(7, 3, s)) for s in (0, 1, 2)] == [[0, 1], [2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="pipeline_parallel_size: cannot be combined with tensor_parallel"):
        EngineConfig(model="demo", pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match="speculative: a draft model is not supported with pipeline_parallel"
    ):
        EngineConfig(model="demo", pipeline_parallel_size=2, speculative="draft:demo")
    args = ModelArgs.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    with pytest.raises(ValueError, match="pipeline_parallel_size: .* 2 layers for 3 stages"):
        Stage(0, 3).local_args(args)


def test_prompt_logprobs_refused(engines):
    llm = engines["qwen2"][0]
    with pytest.raises(ValueError, match="prompt_logprobs: not supported with pipeline_parallel_size 2"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0))
    _pool_whole(llm)


def test_stopped_stage_is_ended_by_its_heartbeat(engines):
    """A stage that stops (SIGSTOP: alive, silent) is ended by rank 0's watchdog once its heartbeat is stale,
    well before a collective timeout; the requests fail naming it. Last use of the qwen2 engine."""
    llm, prompts, _ = engines["qwen2"]
    eng = llm.engine
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:2]]
    outs = {o.request_id: o for o in eng.step()}
    (pid,) = eng.tp.pids().values()
    os.kill(pid, signal.SIGSTOP)
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    for rid in ids:
        assert outs[rid].finish_reason == "abort"
        assert "pipeline-parallel worker rank 1" in outs[rid].abort_reason
        assert "after its heartbeat stopped for" in outs[rid].abort_reason
    assert eng.tp.watchdog.hung.keys() == {1}
    _pool_whole(llm)


def test_killed_stage_fails_requests_instead_of_hanging(engines):
    """Last in this module: it breaks the llama engine's stages for good."""
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
        assert time.monotonic() < deadline, "the engine hung after its stage died"
        for o in eng.step():
            outs[o.request_id] = o
    for rid in ids:
        assert outs[rid].finished and outs[rid].finish_reason == "abort"
        assert "TPWorkerLost: pipeline-parallel worker rank 1" in outs[rid].abort_reason
    _pool_whole(llm)


def test_rendezvous_settings_are_checked_and_torchrun_fills_them():
    base = dict(model="demo", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="nnodes: must divide the ranks"):
        EngineConfig(**base, nnodes=3, master_port=29500)
    with pytest.raises(ValueError, match=r"node_rank: must be in \[0, nnodes = 2\)"):
        EngineConfig(**base, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(ValueError, match="master_port: must be set"):
        EngineConfig(**base, nnodes=2)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    cfg = EngineConfig(**base).with_torchrun_env(torchrun)
    assert (cfg.node_rank, cfg.nnodes, cfg.master_addr, cfg.master_port) == (1, 2, "10.0.0.5", 29500)
    # Flags win over the environment, and a partial torchrun environment is not torchrun's.
    assert EngineConfig(**base, master_addr="host-a").with_torchrun_env(torchrun).master_addr == "host-a"
    assert EngineConfig(**base).with_torchrun_env({"RANK": "1"}).nnodes == 1
    with pytest.raises(ValueError, match="MASTER_PORT: must be an integer"):
        EngineConfig(**base).with_torchrun_env({**torchrun, "MASTER_PORT": "x"})


@pytest.mark.parametrize("kind", ["qwen3_moe_step", "deepseek_v3"])
def test_two_stages_of_experts_and_latent_attention_match_hf(tmp_path, demo_dir, kind):
    """Qwen3-MoE (dense and sparse layers, tied head) and DeepSeek V3 (latent caches on both stages, routed
    and shared experts, a dense first layer), with preemption and chunked prefill."""
    import transformers as tf

    from tests.unit.model.family_checkpoints import build_family_checkpoint
    from tests.unit.model.latent_checkpoints import build_latent_checkpoint

    build = build_latent_checkpoint if kind == "deepseek_v3" else build_family_checkpoint
    path = build(kind, tmp_path / kind, demo_dir)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    prompts = _prompts(hf.config.vocab_size)[:5]
    llm = LLM(
        model=str(path),
        dtype="float32",
        pipeline_parallel_size=2,
        block_size=8,
        num_kv_blocks=16,
        max_num_batched_tokens=16,
    )
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == hf_generate(hf, prompts, MAX_NEW)
        assert llm.stats()["num_preemptions"] > 0
        _pool_whole(llm)
    finally:
        llm.engine.tp.close()


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_loads_only_the_tables_it_uses(tmp_path, demo_dir, tied):
    """Stage 0 of 2 reads the embedding but not the norm or head; the last stage reads the head (and the
    embedding only where the head is tied to it); a middle stage reads neither."""
    from sidecar.model.loader import load_model

    path, _ = _checkpoint("qwen2" if tied else "llama", 3, tmp_path / "m", demo_dir)
    cfg = EngineConfig(model=str(path), dtype="float32")
    first = load_model(cfg, pack=False, shard=Stage(0, 3)).model
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    middle = load_model(cfg, pack=False, shard=Stage(1, 3)).model
    assert (middle.embed_tokens, middle.lm_head, middle.norm) == (None, None, None)
    last = load_model(cfg, pack=False, shard=Stage(2, 3)).model
    assert last.embed_tokens is None and not last.lm_head.weight.is_meta and not last.norm.weight.is_meta
    if tied:  # the head reads the embedding's table, loaded on this stage for it
        assert last.lm_head.weight.abs().sum() > 0


def test_a_decoder_of_its_own_is_refused_by_name():
    from tests.unit.model.gemma4_checkpoints import gemma4_config

    cfg = gemma4_config(64).to_dict()
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    args = ModelArgs.from_hf_config(cfg)
    with pytest.raises(ValueError, match="pipeline_parallel_size: .* a decoder of its own"):
        Stage(0, 2).local_args(args)
