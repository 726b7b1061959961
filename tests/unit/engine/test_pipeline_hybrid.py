"""Pipeline parallelism of a hybrid model (Qwen3.5: gated DeltaNet layers, then a gated full-attention layer)
over gloo on CPU. Of its four layers, stage 0 holds two linear-attention layers (state slots, no KV cache at
all) and stage 1 a linear and the attention layer. Two stages with two micro-batches in flight give HF
float32's greedy tokens through preemption (states rebuilt by recomputation), chunked prefill (states carried
across chunk edges on both stages), prefix hits (states restored from checkpoints on every stage) and an
abort; the KV pool, the state slots and the checkpoint rows are whole afterwards."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar import LLM, SamplingParams
from sidecar.model.pp_stage import Stage, stage_args
from tests.unit.engine.test_pipeline_parallel import _pool_whole
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.test_hybrid_vs_hf import hf_greedy_logprobs

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
SHARED = [11 + (13 * j) % 700 for j in range(24)]  # three whole 8-token blocks
# Prompts of different lengths (one of a single token: a decode row from the start), two sharing SHARED.
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 1, 22])] + [
    SHARED + [901, 17, 333],
    SHARED + [42, 7, 250, 61, 88],
]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, demo_dir):
    path = build_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("pph") / "qwen3_5", demo_dir)
    ref = hf_greedy_logprobs(path, PROMPTS)  # (tokens, their logprobs) of each prompt
    assert_not_degenerate([toks for toks, _ in ref])  # else equality would not exercise the layers
    llm = LLM(
        model=str(path),
        dtype="float32",
        pipeline_parallel_size=2,
        block_size=8,
        num_kv_blocks=8,  # 56 tokens (and two state slots) for seven requests of up to 38: preemption
        max_num_batched_tokens=16,  # prompts arrive in chunks
        max_num_seqs=4,
    )
    try:
        yield llm, ref
    finally:
        llm.engine.tp.close()


def _whole(llm: LLM) -> None:
    """Rank 0 decides every stage's KV blocks and state slots: its accounting is every stage's."""
    _pool_whole(llm)
    kv = llm.engine.kv
    assert kv.slots.whole() and kv.ckpts.whole()


def test_prefix_hits_restore_the_states_on_every_stage(hybrid):
    """First on the module's engine: its pool and checkpoints fresh."""
    llm, ref = hybrid
    (first,) = llm.generate([PROMPTS[-2]], LOGPROBS)  # its chunk ends at 24: the state there checkpointed
    restored = llm.stats()["state_checkpoints_restored"]
    (hit,) = llm.generate([PROMPTS[-1]], LOGPROBS)  # SHARED's blocks hit, both stages' states restored
    for out, (toks, lps) in zip((first, hit), ref[-2:]):  # logprobs too: a stale state would show there
        assert out.token_ids == toks
        assert [t.logprob for t in out.logprobs] == pytest.approx(lps, abs=1e-4)
    assert hit.num_cached_tokens == 24
    assert llm.stats()["state_checkpoints_restored"] == restored + 1
    _whole(llm)


def test_two_stages_match_hf_with_preemption_chunks_and_parts_in_flight(hybrid):
    llm, ref = hybrid
    eng, pp = llm.engine, llm.engine.tp
    # stage 0: layers 0 and 1, both linear: state slots of two layers and an empty KV pool
    assert eng.runner.kv_caches == [] and len(eng.runner.states.conv) == 2
    before = pp.split_steps
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [toks for toks, _ in ref]
    assert llm.stats()["num_preemptions"] > 0
    assert pp.split_steps > before  # steps with decode rows and prompt chunks did run in parts
    _whole(llm)


def test_an_abort_returns_its_slot_while_others_run_in_parts(hybrid):
    llm, ref = hybrid
    eng = llm.engine
    lens = [2, MAX_NEW, 3, MAX_NEW, 5]
    prompts = PROMPTS[:3] + PROMPTS[4:6]
    expect = [toks for toks, _ in ref[:3] + ref[4:6]]
    ids = [
        eng.add_request(None, p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lens)
    ]
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
        if steps == 5:  # mid-generation, its slot held, others decoding in the same step
            eng.abort(ids[3])
    assert outs[ids[3]].finish_reason == "abort"
    assert expect[3][: len(outs[ids[3]].token_ids)] == outs[ids[3]].token_ids
    for i in (0, 1, 2, 4):
        assert outs[ids[i]].finish_reason == "length" and outs[ids[i]].token_ids == expect[i][: lens[i]]
    _whole(llm)
    # a slot freed by the abort is taken again from rest: the next request is exact
    assert llm.generate([PROMPTS[3]], GREEDY)[0].token_ids == ref[3][0]
    _whole(llm)


def test_stage_args_number_a_stages_layers_from_zero():
    from sidecar.model.args import LinearAttention, ModelArgs

    args = ModelArgs.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    spec = LinearAttention(num_k_heads=1, num_v_heads=1, k_dim=8, v_dim=8, conv_kernel=4)
    hybrid = dataclasses.replace(args, linear_layers=(0, 1, 2, 4), linear=spec)
    first, second = (stage_args(hybrid, Stage(s, 2)) for s in (0, 1))
    assert (first.num_layers, first.linear_layers, len(first.kv_shapes())) == (3, (0, 1, 2), 0)
    assert (second.num_layers, second.linear_layers, len(second.kv_shapes())) == (3, (1,), 2)
    Stage(1, 2).local_args(hybrid)  # a hybrid model splits
