"""Gemma 4 text (gemma4_checkpoints.py) through the engine: greedy float32 equal to HF transformers
``generate`` token for token -- sliding layers whose window is shorter than the prompts beside full layers of
other head sizes, per-layer input embeddings, the last layers sharing earlier layers' KV, and the MoE variant
-- with a tight pool (preemption), a small token budget (prompts chunked across window edges) and prefix-cache
hits, the pool whole after each; the cache holding each owning layer at its own shape, in KV groups
(engine/kv_groups.py; test_kv_groups_gemma4.py pages them in detail). The MoE
checkpoint's sliding layers have a head size the CPU attention kernels decline: logged, and the torch path
runs them."""

from __future__ import annotations

import logging

import pytest

from sidecar import LLM, SamplingParams
from sidecar.engine.kv_budget import kv_bytes_per_block
from sidecar.model.gemma4 import kv_sources
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.gemma4_checkpoints import build_gemma4_checkpoint, build_gemma4_vl_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# The window is 6 tokens: every prompt but the first two crosses it, and 16-token steps chunk the long ones
# across it.
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 1, 30, 40])]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("gemma4")
    return {
        "dense": build_gemma4_checkpoint(root / "dense", demo_dir),
        # sliding heads of 12: not a multiple of the CPU kernels' lanes
        "moe": build_gemma4_checkpoint(root / "moe", demo_dir, moe=True, head_dim=12),
    }


@pytest.fixture(scope="module")
def refs(dirs):
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = hf_greedy(dirs[kind], PROMPTS, MAX_NEW)
            assert_not_degenerate(cache[kind])  # else equality would not exercise the layers
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_matches_hf_with_preemption_chunking_and_prefix_hits(dirs, refs, kind, caplog):
    ref = refs(kind)
    # 15 usable pages of 8 tokens, each one KV group's (a full and two sliding groups), cannot hold the 4
    # requests (up to 48 tokens each) at once.
    with caplog.at_level(logging.INFO, logger="sidecar.model"):
        llm = LLM(
            model=str(dirs[kind]), dtype="float32", block_size=8, num_kv_blocks=16, max_num_batched_tokens=16
        )
    refusals = [r.getMessage() for r in caplog.records if "torch path" in r.getMessage()]
    if kind == "moe":  # the sliding layers, their own and those reading layer 2's cache
        assert len(refusals) == 1 and "layers [0, 2, 3]" in refusals[0] and "not 12" in refusals[0]
    else:
        assert not refusals
    a = llm.engine.loaded.args
    assert a.architecture == "Gemma4ForCausalLM" and a.kv_source == (0, 1, 2, 2, 1)
    assert a.num_experts == (4 if kind == "moe" else 0)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)
    first, again = (llm.generate(PROMPTS[3:4], GREEDY)[0] for _ in range(2))  # again: from the prefix cache
    assert first.token_ids == again.token_ids == ref[3]
    assert again.num_cached_tokens >= 32
    assert_pool_whole(llm)


def test_each_layer_keeps_its_own_shape_once(dirs, refs):
    llm = LLM(model=str(dirs["dense"]), dtype="float32", block_size=8)
    eng = llm.engine
    # layers 0, 2 (sliding: 2 KV heads of 16) and 1 (full: 1 KV head of 32) keep caches; 3 and 4 read 2's
    # and 1's. In KV groups (one layer each) the sliding layers page one tensor of their shape, each block
    # one group's; the single-table layout would hold every owning layer in each block.
    caches = eng.runner.kv_caches
    assert [tuple(k.shape[2:]) for k, _ in caches] == [(2, 16), (1, 32), (2, 16)]
    assert caches[0] is caches[2] and caches[1] is not caches[0]
    assert all(k.shape == v.shape for k, v in caches)
    assert kv_bytes_per_block(eng.loaded, 8) == 2 * 8 * (2 * 16 + 32 + 2 * 16) * 4
    assert kv_bytes_per_block(eng.loaded, 8, plan=eng.runner.kv_plan) == 2 * 8 * (2 * 16 + 32) * 4
    info = eng.model_info
    assert [(g["kind"], g["layers"], g.get("shared_layers")) for g in info["cache_groups"]] == [
        ("attention", 1, 1),
        ("sliding_attention", 1, None),
        ("sliding_attention", 1, 1),
    ]
    assert info["cpu_decode_replay"] is False and "per-layer inputs" in info["cpu_decode_replay_reason"]
    # one batch, sequences of different lengths decoding together
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == refs("dense")
    assert_pool_whole(llm)


def test_what_it_cannot_do_is_refused_naming_the_field(dirs):
    with pytest.raises(ValueError, match="lora: Gemma4ForCausalLM is a mixture-of-experts model"):
        LLM(model=str(dirs["moe"]), enable_lora=True)
    # a shared layer needs an earlier layer of its kind to read from
    with pytest.raises(ValueError, match="num_kv_shared_layers 3"):
        kv_sources(["sliding_attention", "full_attention", "full_attention", "sliding_attention"], 3)
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert kv_sources(kinds, 2) == (0, 1, 0, 1)


def test_the_published_vision_language_form_serves_its_text_model(dirs, refs, tmp_path):
    import torch
    import transformers as tf

    d = build_gemma4_vl_checkpoint(dirs["dense"], tmp_path / "vl")
    # HF's two forms of the one text model agree on a prompt's logits; ours continues it as HF's causal form
    prompt = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        vl = tf.Gemma4ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32)(prompt).logits
        causal = tf.Gemma4ForCausalLM.from_pretrained(str(dirs["dense"]), dtype=torch.float32)(prompt).logits
    assert torch.equal(vl, causal)
    llm = LLM(model=str(d), dtype="float32", block_size=8, max_num_batched_tokens=16)
    assert llm.engine.loaded.args.checkpoint_prefix == "model.language_model."
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == refs("dense")
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "fields",
    [
        dict(global_head_dim=48, num_global_key_value_heads=1, attention_k_eq_v=True),
        dict(global_head_dim=48, num_global_key_value_heads=1),  # without k = v the KV heads stay
        dict(),  # full layers 512 wide by default
    ],
)
def test_configs_written_without_per_layer_config_map_as_transformers_reads_them(fields):
    import transformers as tf

    from sidecar.model.args import ModelArgs

    # the published configs: global_head_dim / num_global_key_value_heads, no per_layer_config
    raw = dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **fields,
    )
    hf = tf.Gemma4TextConfig(**raw)
    a = ModelArgs.from_hf_config(raw)
    layers = hf.per_layer_config
    assert a.layer_head_dims == tuple(layers[i].head_dim for i in range(6))
    assert a.layer_kv_heads == tuple(layers[i].num_key_value_heads for i in range(6))
    assert a.layer_head_dims[5] == fields.get("global_head_dim", 512) and a.layer_head_dims[0] == 16
