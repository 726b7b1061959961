"""Qwen3.5 (gated DeltaNet layers among gated full-attention layers; family_checkpoints.py) through the engine:
greedy float32 equal to HF transformers ``generate`` token for token with sequences of different lengths
decoding in one batch, a tight KV pool (preemption: the state rebuilt by recomputation), a small token budget
(prompts chunked, the state carried across chunk edges and across the rule's 64-token blocks), cancellation;
the KV blocks and the state slots all back after each; the recurrence against HF's torch reference."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.kv_budget import kv_bytes_per_block
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# One prompt longer than the rule's 64-token blocks; one of a single token (a decode row from the start).
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 70, 1, 22])]


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, demo_dir):
    return build_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("hybrid") / "qwen3_5", demo_dir)


@pytest.fixture(scope="module")
def hf_ref(qwen35_dir):
    ref = hf_greedy(qwen35_dir, PROMPTS, MAX_NEW)
    assert_not_degenerate(ref)  # else equality would not exercise the layers
    return ref


def assert_slots_whole(llm: LLM) -> None:
    assert_pool_whole(llm)
    assert llm.engine.kv.slots.whole()
    assert llm.engine.kv.ckpts is None or llm.engine.kv.ckpts.whole()


def test_greedy_matches_hf_in_one_batch(qwen35_dir, hf_ref, monkeypatch):
    # the decode rows run on the C kernel (deltanet_step.c) wherever it is built: count its steps
    from sidecar.model import deltanet

    steps = []
    kernel_step = deltanet.kernel_step

    def counted(*args):
        out = kernel_step(*args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(deltanet, "kernel_step", counted)
    # and the prompt chunks on the C chunk (deltanet_prefill.kernel_chunk: convolution, rule, gated norm)
    chunks, kernel_chunk = [], deltanet.kernel_chunk

    def counted_chunks(*args):
        out = kernel_chunk(*args)
        chunks.append(out is not None)
        return out

    monkeypatch.setattr(deltanet, "kernel_chunk", counted_chunks)
    llm = LLM(model=str(qwen35_dir), dtype="float32")
    eng = llm.engine
    assert eng.loaded.args.linear_layers == (0, 1, 2)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_ref
    assert steps and all(steps) and deltanet.kernel_ready()
    assert len(chunks) >= 3 * (len(PROMPTS) - 1) and all(chunks)  # every prompt of more than a token
    assert_slots_whole(llm)
    info = eng.model_info
    # prefix caching on, with as many state checkpoints as slots
    assert info["prefix_caching"] is True and eng.kv.ckpts is not None
    # a slot per running sequence, the states bounded by the KV pool's bytes
    slots = min(eng.config.max_num_seqs, info["kv_cache_bytes"] // info["linear_state_bytes_per_sequence"])
    assert info["linear_attention_layers"] == 3 and info["linear_state_slots"] == slots
    # float32 products run in oneDNN, outside our kernels: decode steps stay eager (bf16 ones replay:
    # tests/unit/engine/test_hybrid_replay.py)
    assert info["cpu_decode_replay"] is False and "outside our kernels" in info["cpu_decode_replay_reason"]
    a = eng.loaded.args
    spec = a.linear
    per_seq = 3 * 4 * (spec.conv_dim * (spec.conv_kernel - 1) + spec.num_v_heads * spec.k_dim * spec.v_dim)
    kv, state = info["cache_groups"]
    assert kv == {
        "kind": "attention",
        "layers": 1,
        "bytes": info["kv_cache_bytes"],
        "tokens": info["kv_cache_tokens"],
    }
    assert state["kind"] == "linear_attention" and state["layers"] == 3
    assert state["bytes_per_sequence"] == per_seq and state["bytes"] == per_seq * state["slots"]
    assert state["checkpoints"] == slots and state["checkpoint_bytes"] == per_seq * slots


def test_greedy_matches_hf_with_preemption_and_chunked_prefill(qwen35_dir, hf_ref):
    # 9 usable blocks of 8 tokens cannot hold the requests (up to 78 tokens each) at once; 16 tokens a step
    # split every longer prompt into chunks, the 70-token one across the rule's 64-token block edge too.
    llm = LLM(
        model=str(qwen35_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=11,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    # the states may take no more bytes than the KV pool: fewer slots than running sequences, so sequences
    # wait for a slot too
    assert llm.engine.runner.states.slots < 4
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_slots_whole(llm)


def test_a_cancelled_sequence_returns_its_slot_and_the_others_stay_exact(qwen35_dir, hf_ref):
    llm = LLM(model=str(qwen35_dir), dtype="float32", max_num_batched_tokens=24, max_num_seqs=2)
    eng = llm.engine
    ids = [eng.add_request(None, p, GREEDY) for p in PROMPTS[:3]]
    eng.step()
    eng.step()
    held = dict(eng.kv.slots.held)
    assert ids[0] in held and len(held) == 2  # two sequences running, the third waits for a slot
    eng.abort(ids[0])
    assert ids[0] not in eng.kv.slots.held and len(eng.kv.slots.free) == 1
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[ids[0]].finish_reason == "abort"
    # the third took the freed slot, zeroed, and its state is its own
    assert [done[i].token_ids for i in ids[1:]] == hf_ref[1:3]
    assert_slots_whole(llm)


def test_the_published_vision_language_form_serves_its_text_model(tmp_path, demo_dir):
    import transformers as tf

    d = build_family_checkpoint("qwen3_5_vl", tmp_path / "qwen3_5_vl", demo_dir)
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32)
    prompts = PROMPTS[1:3]
    with torch.no_grad():
        ref = [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(model=str(d), dtype="float32")
    assert llm.engine.loaded.args.checkpoint_prefix == "model.language_model."
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert_slots_whole(llm)


def test_beam_search_forks_the_state_and_matches_hf(qwen35_dir):
    from sidecar import BeamSearchParams
    from tests.unit.engine.test_beam_search import hf_beams, load_hf

    prompt = PROMPTS[2]
    llm = LLM(model=str(qwen35_dir), dtype="float32", block_size=8)
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    ref = hf_beams(load_hf(qwen35_dir), prompt, width=3, max_new=6)
    # each forked beam continues from a copy of its parent's state: HF's ranked beams, token for token; the
    # scores to float32 rounding of the recurrence's sums
    assert [s.token_ids for s in out.sequences] == [ids for ids, _ in ref]
    assert [s.score for s in out.sequences] == pytest.approx([score for _, score in ref], rel=1e-4)
    assert_slots_whole(llm)


def test_speculation_steps_aside_with_its_reason(qwen35_dir, demo_dir, hf_ref):
    llm = LLM(model=str(qwen35_dir), dtype="float32", speculative="ngram")
    assert not llm.engine.spec.enabled  # logged at start; plain decoding, the same tokens
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == hf_ref[:2]
    assert_slots_whole(llm)
    with pytest.raises(ValueError, match="speculative: draft model .* linear-attention layers"):
        LLM(model=str(demo_dir), dtype="float32", speculative=f"draft:{qwen35_dir}")


def test_the_recurrence_matches_hf_and_carries_across_chunks():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from sidecar.model.deltanet_rule import chunked_rule, recurrent_step

    torch.manual_seed(0)
    b, n, nk, nv, dk, dv = 1, 70, 2, 4, 8, 6
    q, k = torch.randn(b, n, nk, dk), torch.randn(b, n, nk, dk)
    v = torch.randn(b, n, nv, dv)
    g, beta = -torch.rand(b, n, nv) * 0.5, torch.rand(b, n, nv)
    s0 = torch.randn(b, nv, dk, dv) * 0.1
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = chunked_rule(q, k, v, g, beta, s0)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    # the same tokens in two chunks (the state carried between them) and then one at a time
    cut = 40
    o1, s1 = chunked_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    o2, s2 = chunked_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    torch.testing.assert_close(torch.cat((o1, o2), 1), ref_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s2, ref_s, rtol=1e-4, atol=1e-5)
    step_o, step_s = [], s0
    for t in range(n):
        sl = slice(t, t + 1)
        o_t, step_s = recurrent_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], step_s)
        step_o.append(o_t)
    ref_step_o, ref_step_s = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.equal(torch.cat(step_o, 1), ref_step_o) and torch.equal(step_s, ref_step_s)


def test_the_kv_pool_counts_only_the_attention_layers(qwen35_dir):
    from sidecar.config import EngineConfig
    from sidecar.model.loader import load_model

    loaded = load_model(EngineConfig(model=str(qwen35_dir), dtype="float32"), pack=False)
    a = loaded.args
    dense = 2 * a.num_layers * 16 * a.num_kv_heads * a.head_dim * 4  # every layer attention, float32
    assert kv_bytes_per_block(loaded, 16) * 4 == dense  # one attention layer of four


def test_a_bad_layer_pattern_is_named():
    from sidecar.model.args import ModelArgs

    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "layer_types": ["linear_attention", "mamba"],
    }
    with pytest.raises(ValueError, match="layer_types"):
        ModelArgs.from_hf_config(cfg)
    args = ModelArgs.from_hf_config(dict(cfg, layer_types=["linear_attention", "full_attention"]))
    assert args.linear_layers == (0,) and args.attention_layers == (1,) and args.rotary == 4


def test_quantized_weights_cover_the_linear_attention_layers(qwen35_dir):
    from tests.unit.server.test_kv_cache_dtype import prompts

    ps, one = prompts(16, seed=3), SamplingParams(max_tokens=1, ignore_eos=True)

    def first(llm: LLM) -> list[int]:
        return [o.token_ids[0] for o in llm.generate(ps, one)]

    ref = first(LLM(model=str(qwen35_dir), dtype="float32", num_kv_blocks=64))
    for mode, bar in (("int8", 0.8), ("int4", 0.2)):  # the bars of test_quant_model on random weights
        llm = LLM(
            model=str(qwen35_dir), dtype="float32", num_kv_blocks=64, quantization=mode, quant_group_size=32
        )
        layers = llm.engine.loaded.model.layers
        # the DeltaNet's wide projections and the attention's gate are quantized too
        assert mode in type(layers[0].linear_attn.in_proj).__name__.lower()
        assert mode in type(layers[3].self_attn.gate_proj).__name__.lower()
        assert sum(a == b for a, b in zip(ref, first(llm))) / len(ps) >= bar, mode
        assert_slots_whole(llm)


def hf_greedy_logprobs(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """HF's greedy continuations and each chosen token's log-probability (which a wrong state would move even
    where the greedy choice stays)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            g = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            toks = g.sequences[0, len(p) :].tolist()
            lps = [torch.log_softmax(sc[0], -1)[t].item() for sc, t in zip(g.scores, toks)]
            out.append((toks, lps))
    return out


def assert_equal_to_hf(model_dir, prompts, outs) -> None:
    for (toks, lps), o in zip(hf_greedy_logprobs(model_dir, prompts), outs):
        assert o.token_ids == toks
        assert [t.logprob for t in o.logprobs] == pytest.approx(lps, abs=1e-4)


LOGPROBS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
BASE = PROMPTS[3]  # 70 tokens: with 8-token blocks its prompt chunk ends at 64 (a checkpoint), decode at 72
EXTRA = [901, 17, 333, 42, 7, 250, 61, 88, 19, 4]


def test_prefix_hits_restore_checkpointed_states_exactly(qwen35_dir):
    llm = LLM(model=str(qwen35_dir), dtype="float32", block_size=8)
    eng = llm.engine
    (first,) = llm.generate([BASE], LOGPROBS)
    assert eng.kv.prefix_hits == 0 and eng.kv.ckpts.saved >= 2
    prompts = [
        BASE + EXTRA,  # shares the prompt: a hit up to its checkpoint at 64
        BASE[:45] + EXTRA[:7],  # shares five whole blocks, none checkpointed: recomputed from rest
        BASE + first.token_ids + EXTRA[:5],  # a next turn: a hit up to decode's checkpoint at 72
    ]
    outs = llm.generate(prompts, LOGPROBS)
    assert_equal_to_hf(qwen35_dir, [BASE] + prompts, [first] + outs)
    assert [o.num_cached_tokens for o in outs] == [64, 0, 72]
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == 64 + 72 and stats["state_checkpoints_restored"] == 2
    assert_slots_whole(llm)


def test_a_hit_whose_checkpoint_was_evicted_recomputes(qwen35_dir):
    # one slot, so one checkpoint: each new block end a sequence reaches evicts the one before
    llm = LLM(model=str(qwen35_dir), dtype="float32", block_size=8, max_num_seqs=1)
    eng = llm.engine
    assert eng.runner.states.checkpoints == 1
    (first,) = llm.generate([BASE], LOGPROBS)
    turn = BASE + first.token_ids + EXTRA[:5]
    shared = BASE + EXTRA
    (a,) = llm.generate([turn], LOGPROBS)  # its checkpoint at 72 survived
    (b,) = llm.generate([shared], LOGPROBS)  # its checkpoint at 64 was evicted: no hit
    assert_equal_to_hf(qwen35_dir, [BASE, turn, shared], [first, a, b])
    assert (a.num_cached_tokens, b.num_cached_tokens) == (72, 0)
    assert eng.kv.ckpts.evicted > 0 and eng.kv.ckpts.restored == 1
    assert_slots_whole(llm)


def test_a_preempted_sequence_takes_its_prefix_back_from_a_checkpoint(qwen35_dir):
    # 13 usable blocks of 8 tokens cannot hold three ~80-token sequences: one is preempted, and readmitted
    # it hits its own published blocks and the checkpoint saved at their end
    llm = LLM(
        model=str(qwen35_dir),
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,
        max_num_batched_tokens=16,
        max_num_seqs=3,
    )
    prompts = [BASE, BASE + EXTRA, BASE + EXTRA[:5] + [3] * 20]
    outs = llm.generate(prompts, LOGPROBS)
    assert_equal_to_hf(qwen35_dir, prompts, outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    # two admissions hit the first prompt's checkpoint at 64; a readmission restored one more
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64] and stats["state_checkpoints_restored"] > 2
    assert_slots_whole(llm)


def test_offload_tiers_step_aside_and_caching_stays(qwen35_dir, caplog):
    with caplog.at_level("WARNING", logger="sidecar.engine"):
        llm = LLM(model=str(qwen35_dir), dtype="float32", kv_offload_gb=0.01)
    assert llm.engine.kv.offload is None and llm.engine.kv.enable_caching
    assert "KV offload off: linear-attention layers" in caplog.text


def test_a_recomputed_prefix_stays_findable_when_the_first_copy_is_evicted(qwen35_dir):
    # 8 usable blocks of 8 tokens: one sequence at a time, each taking the blocks the one before freed
    llm = LLM(model=str(qwen35_dir), dtype="float32", block_size=8, num_kv_blocks=9, max_num_seqs=1)
    eng = llm.engine
    first = BASE[:45] + EXTRA[:7]  # caches BASE's first five blocks, checkpoints only past them
    again = BASE[:40] + [3]  # finds those five blocks, none checkpointed: recomputes them as duplicates
    (a,) = llm.generate([first], LOGPROBS)
    (b,) = llm.generate([again], LOGPROBS)
    assert b.num_cached_tokens == 0
    # its allocations evicted every block of the first copy: the recomputed copy must serve the hit
    assert not any(blk.ref_cnt for blk in eng.kv.pool.blocks[1:])
    turn = again + b.token_ids + EXTRA[:3]  # a next turn: a hit up to decode's checkpoint at 48
    (c,) = llm.generate([turn], LOGPROBS)
    assert_equal_to_hf(qwen35_dir, [first, again, turn], [a, b, c])
    assert c.num_cached_tokens == 48 and eng.kv.ckpts.restored == 1
    assert_slots_whole(llm)
    assert eng.kv.pool.consistent()
