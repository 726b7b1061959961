"""DeepSeek V3 and Mistral 4 (multi-head latent attention, grouped routing with shared experts;
latent_checkpoints.py) through the engine: greedy float32 equal to HF transformers ``generate`` token for
token (decode rows in the CPU latent kernel) with a tight KV pool (preemption), a small token budget (prompts
chunked), prefix-cache hits and n-gram speculation; the pool whole after each; the cache holding the latent
and its rotary key part per token, and the budget counting that; int8 KV and tensor parallelism refused by
name."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.kv_budget import kv_bytes_per_block
from sidecar.model.kernels.cpu import latent_attention as cpu_latent
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.latent_checkpoints import LATENT_FAMILIES, build_latent_checkpoint

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# Lengths across block (8) and chunk (16) edges, past Mistral 4's query-scale steps (16, 32); one of a
# single token (a decode row from the start).
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 30, 45, 1])]


@pytest.fixture(scope="module")
def latent_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("latent")
    return {k: build_latent_checkpoint(k, root / k, demo_dir) for k in LATENT_FAMILIES}


@pytest.fixture(scope="module")
def hf_refs(latent_dirs):
    import transformers as tf

    classes = {"deepseek_v3": tf.DeepseekV3ForCausalLM, "mistral4": tf.Mistral4ForCausalLM}
    refs = {}
    for kind, d in latent_dirs.items():
        refs[kind] = hf_generate(classes[kind].from_pretrained(str(d), dtype=torch.float32), PROMPTS, MAX_NEW)
        assert_not_degenerate(refs[kind])  # else equality would not exercise the layers
    return refs


def _count_kernel_calls(monkeypatch) -> list[int]:
    """[calls of the CPU latent decode kernel that returned its result], counted as the engine runs."""
    from sidecar.model.kernels.cpu import latent_attention

    taken, real = [0], latent_attention.decode_attention

    def counted(*args, **kw):
        out = real(*args, **kw)
        taken[0] += out is not None
        return out

    monkeypatch.setattr(latent_attention, "decode_attention", counted)
    return taken


@pytest.mark.parametrize("kind", LATENT_FAMILIES)
def test_greedy_matches_hf_with_preemption_chunking_and_prefix_hits(latent_dirs, hf_refs, kind, monkeypatch):
    taken = _count_kernel_calls(monkeypatch)
    # 11 usable blocks of 8 tokens cannot hold the 4 requests (up to 51 tokens each) at once
    llm = LLM(
        model=str(latent_dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_refs[kind]
    # the decode rows attended in the CPU latent kernel: float32 with few heads is where it is the faster path
    heads = llm.engine.loaded.args.num_heads
    assert cpu_latent.slower_than_torch(torch.float32, heads) is None and taken[0] > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)
    first, again = (llm.generate(PROMPTS[2:3], GREEDY)[0] for _ in range(2))  # again: from the prefix cache
    assert first.token_ids == again.token_ids == hf_refs[kind][2]
    assert again.num_cached_tokens >= 40
    assert_pool_whole(llm)
    # the CPU decode replays and the paged-attention kernels step aside, saying why
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is False and info["cpu_decode_replay_reason"]


def test_the_cache_holds_the_latent_and_the_budget_counts_it(latent_dirs):
    llm = LLM(model=str(latent_dirs["deepseek_v3"]), dtype="float32", block_size=8, num_kv_blocks=20)
    eng = llm.engine
    a = eng.loaded.args
    assert a.latent.kv_lora_rank < a.num_heads * a.head_dim  # 16 < 4 x (16 + 8)
    # first_k_dense_replace: a dense first layer, then experts with a shared one
    assert a.dense_layers == (0,) and a.sparse(1) and a.sparse(2)
    for latent, rope in eng.runner.kv_caches:
        assert latent.shape == (20, 8, 1, 16) and rope.shape == (20, 8, 1, 8)
    per_block = 3 * 8 * (16 + 8) * 4  # layers x tokens x (latent + rotary key) x float32
    assert kv_bytes_per_block(eng.loaded, 8) == per_block
    info = eng.model_info
    assert info["kv_cache_bytes"] == 20 * per_block
    assert info["cache_groups"] == [
        {"kind": "latent_attention", "layers": 3, "bytes": 20 * per_block, "tokens": 19 * 8}
    ]
    dense = 2 * 3 * 8 * a.num_heads * a.head_dim * 4  # per-head K and V of the same heads
    assert per_block * 8 == dense  # a sixteenth of expanded keys and values here
    # a memory budget buys as many blocks as the latent size allows
    sized = LLM(
        model=str(latent_dirs["deepseek_v3"]), dtype="float32", block_size=8, kv_cache_memory_gb=2**-14
    )
    assert sized.engine.runner.num_blocks == 2**16 // per_block + 1


def test_ngram_speculation_verifies_on_the_latents(latent_dirs):
    import transformers as tf

    d = latent_dirs["mistral4"]
    # every token id once: whatever the model picks recurs in its context, so the n-gram proposer proposes
    prompt = list(range(3, 973))
    ref = hf_generate(tf.Mistral4ForCausalLM.from_pretrained(str(d), dtype=torch.float32), [prompt], MAX_NEW)
    llm = LLM(model=str(d), dtype="float32", block_size=8, speculative="ngram", speculative_token_cost=0.0)
    assert llm.generate([prompt], GREEDY)[0].token_ids == ref[0]
    spec = llm.engine.spec
    assert spec.enabled and spec.num_proposed > 0  # verification rows attended on the latents
    assert_pool_whole(llm)


def test_int8_kv_and_tensor_parallelism_are_refused_by_name(latent_dirs):
    from sidecar.model.args import ModelArgs
    from sidecar.model.tp_shard import Shard

    with pytest.raises(ValueError, match="kv_cache_dtype: .*latent"):
        LLM(model=str(latent_dirs["mistral4"]), dtype="float32", kv_cache_dtype="int8")
    import json

    cfg = json.loads((latent_dirs["mistral4"] / "config.json").read_text())
    with pytest.raises(ValueError, match="tensor_parallel_size: .*latent attention"):
        Shard(0, 2).check(ModelArgs.from_hf_config(cfg))


def test_scored_eviction_adds_up_the_weights_the_latents_receive(latent_dirs):
    llm = LLM(model=str(latent_dirs["deepseek_v3"]), dtype="float32", block_size=8, num_kv_blocks=12)
    eng, a = llm.engine, llm.engine.loaded.args
    params = SamplingParams(max_tokens=24, ignore_eos=True, kv_budget=32, kv_eviction="h2o")
    rid = eng.add_request(None, PROMPTS[1][:20], params)
    eng.step()  # the prompt: each of its rows gives weight 1 per head and layer to its keys
    torch.testing.assert_close(eng.runner.kv_scores.sum().item(), a.num_layers * a.num_heads * 20.0)
    eng.step()  # one decode row more
    torch.testing.assert_close(eng.runner.kv_scores.sum().item(), a.num_layers * a.num_heads * 21.0)
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[0].request_id == rid and len(outs[0].token_ids) == 24
    assert eng.kv.num_evicted_blocks > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", LATENT_FAMILIES)
def test_parameter_counts_match_the_hf_model(latent_dirs, kind):
    import json

    import transformers as tf

    from sidecar.model.args import ModelArgs
    from sidecar.model.param_count import parameter_counts

    cls = {"deepseek_v3": tf.DeepseekV3ForCausalLM, "mistral4": tf.Mistral4ForCausalLM}[kind]
    hf = cls.from_pretrained(str(latent_dirs[kind]), dtype=torch.float32)
    args = ModelArgs.from_hf_config(json.loads((latent_dirs[kind] / "config.json").read_text()))
    total = sum(p.numel() for p in hf.parameters())
    idle = 0  # routed experts a token does not use (the shared ones always run)
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            n = sum(p.numel() for p in experts.parameters())
            idle += n - n * args.experts_per_token // args.num_experts
    assert parameter_counts(args) == (total, total - idle)


def test_quantized_weights_cover_the_latent_projections_and_shared_experts(latent_dirs):
    from tests.unit.server.test_kv_cache_dtype import prompts

    d, ps, one = (
        latent_dirs["deepseek_v3"],
        prompts(16, seed=3),
        SamplingParams(max_tokens=1, ignore_eos=True),
    )

    def first(llm: LLM) -> list[int]:
        return [o.token_ids[0] for o in llm.generate(ps, one)]

    ref = first(LLM(model=str(d), dtype="float32", num_kv_blocks=64))
    llm = LLM(model=str(d), dtype="float32", num_kv_blocks=64, quantization="int8", quant_group_size=32)
    layer = llm.engine.loaded.model.layers[1]
    for lin in (layer.self_attn.q_a_proj, layer.self_attn.q_b_proj, layer.self_attn.kv_a_proj_with_mqa):
        assert "int8" in type(lin).__name__.lower()
    assert "int8" in type(layer.mlp.shared_experts.down_proj).__name__.lower()
    # random weights with close logits: half the first tokens at least (a broken layer agrees by chance only)
    assert sum(a == b for a, b in zip(ref, first(llm))) / len(ps) >= 0.5
    assert_pool_whole(llm)


def test_the_self_check_turns_the_attention_kernels_off_with_their_reason(latent_dirs, hf_refs):
    from sidecar.engine import self_check
    from sidecar.model.mla import FAST_PATH_REASON

    llm = LLM(model=str(latent_dirs["mistral4"]), dtype="float32", block_size=8)
    runner = llm.engine.runner
    fallbacks = self_check.run(runner, paths=["attention", "rope_kv"])
    assert fallbacks == {"attention": FAST_PATH_REASON, "rope_kv": FAST_PATH_REASON}
    assert not runner.fast_paths.attention and not runner.fast_paths.rope_kv
    # the probe's blocks were put back: serving afterwards is exact
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_refs["mistral4"]
    assert_pool_whole(llm)
