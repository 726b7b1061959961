"""Qwen3.5-MoE and Qwen3-Next (gated DeltaNet layers among gated full-attention layers, with routed experts
and a gated shared expert; family_checkpoints.py) through the engine: greedy float32 equal to HF
transformers ``generate`` token for token in one batch and on a prefix-cache hit restored from a state
checkpoint, and with a tight KV pool (preemption) and a small token budget (chunked prefill, the state carried
across chunks and the rule's 64-token blocks); the published vision-language form's text model;
int8 weights; parameter counts against the HF model's; bad configs refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model.args import ModelArgs
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE
from sidecar.model.param_count import parameter_counts
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.test_hybrid_vs_hf import assert_slots_whole

KINDS = ("qwen3_5_moe", "qwen3_next")
MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# One prompt longer than the rule's 64-token blocks; one of a single token (a decode row from the start).
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 70, 1])]
EXTRA = [901, 17, 333, 42, 7, 250, 61, 88, 19, 4]
HIT = PROMPTS[3] + EXTRA  # shares the 70-token prompt: a hit up to its state checkpoint at 64


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("hybrid_moe")
    return {k: build_family_checkpoint(k, root / k, demo_dir) for k in KINDS}


@pytest.fixture(scope="module")
def refs(dirs):
    out = {k: hf_greedy(dirs[k], PROMPTS + [HIT], MAX_NEW) for k in KINDS}
    for ref in out.values():
        assert_not_degenerate(ref)  # else equality would not exercise the layers
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf_in_one_batch(dirs, refs, kind):
    llm = LLM(model=str(dirs[kind]), dtype="float32")
    loaded = llm.engine.loaded
    layers = loaded.model.layers
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    linear = {"qwen3_5_moe": (0, 1, 2), "qwen3_next": (0, 2)}[kind]
    assert loaded.args.linear_layers == linear
    assert sparse == {"qwen3_5_moe": [True] * 4, "qwen3_next": [False, True, True, True]}[kind]
    moe = layers[1].mlp
    assert moe.shared_expert is not None and moe.shared_expert_gate is not None
    assert moe.norm_topk_prob is (kind == "qwen3_5_moe")  # Qwen3-Next's config says False here
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs[kind][: len(PROMPTS)]
    assert_slots_whole(llm)
    (hit,) = llm.generate([HIT], GREEDY)  # the 70-token prompt's state was checkpointed at its block end 64
    assert hit.token_ids == refs[kind][-1] and hit.num_cached_tokens == 64
    assert llm.stats()["state_checkpoints_restored"] == 1
    assert_slots_whole(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_and_chunked_prefill_match_hf(dirs, refs, kind):
    # 9 usable blocks of 8 tokens cannot hold the requests at once; 16 tokens a step split the longer prompts
    # into chunks (the 70-token one across the rule's 64-token block edge)
    llm = LLM(
        model=str(dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=11,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs[kind][: len(PROMPTS)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_slots_whole(llm)


def test_the_published_vision_language_form_serves_its_text_model(tmp_path, demo_dir):
    import transformers as tf

    d = build_family_checkpoint("qwen3_5_moe_vl", tmp_path / "vl", demo_dir)
    hf = tf.Qwen3_5MoeForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32)
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


def test_int8_weights_cover_experts_and_mixers_but_not_the_gates(dirs):
    from tests.unit.server.test_kv_cache_dtype import prompts

    path = str(dirs["qwen3_5_moe"])
    ps, one = prompts(10, seed=3, hi=30), SamplingParams(max_tokens=1, ignore_eos=True)

    def first(llm: LLM) -> list[int]:
        return [o.token_ids[0] for o in llm.generate(ps, one)]

    ref = first(LLM(model=path, dtype="float32", num_kv_blocks=64))
    mode = "int8"  # int4 takes the same layers (test_quant_model, test_hybrid_vs_hf)
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64, quantization=mode, quant_group_size=32)
    layers = llm.engine.loaded.model.layers
    moe = layers[0].mlp
    quantized = (moe.experts[5].gate_up_proj, moe.shared_expert.down_proj, layers[0].linear_attn.in_proj)
    assert all(mode in type(lin).__name__.lower() for lin in quantized)
    # the router and the shared expert's gate stay in full precision: a rounded one moves tokens
    assert type(moe.gate) is type(moe.shared_expert_gate) is Linear
    # a broken layer agrees on next to none of a 1000-token vocabulary; the bar sits below test_quant_model's
    # 0.8 as a random router's near-ties let int8 rounding move a token to other experts
    assert sum(a == b for a, b in zip(ref, first(llm))) / len(ps) >= 0.6
    assert_slots_whole(llm)


@pytest.mark.parametrize("kind", (*KINDS, "qwen3_5"))
def test_parameter_counts_match_the_hf_model(dirs, tmp_path, demo_dir, kind):
    from transformers import AutoModelForCausalLM

    path = dirs.get(kind) or build_family_checkpoint(kind, tmp_path / kind, demo_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
    total = sum(p.numel() for p in hf.parameters())
    idle = 0  # parameters of the experts a token does not use
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            n = sum(p.numel() for p in experts.parameters())
            idle += n - n * args.experts_per_token // args.num_experts
    assert parameter_counts(args) == (total, total - idle)


BASE = {
    "vocab_size": 10,
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8,
    "layer_types": ["linear_attention", "full_attention"],
}


@pytest.mark.parametrize(
    "arch, bad, field",
    [
        ("Qwen3_5MoeForCausalLM", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("Qwen3_5MoeForCausalLM", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ("Qwen3_5MoeForCausalLM", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
        (
            "Qwen3_5MoeForCausalLM",
            {"linear_num_key_heads": 2, "linear_num_value_heads": 3},
            "linear_num_value",
        ),
        ("Qwen3NextForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("Qwen3NextForCausalLM", {"mlp_only_layers": [2]}, "mlp_only_layers"),
        ("Qwen3NextForCausalLM", {"layer_types": ["linear_attention", "mamba"]}, "layer_types"),
        ("Qwen3NextForCausalLM", {"linear_key_head_dim": None}, "linear_key_head_dim"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(arch, bad, field):
    cfg = dict(BASE, architectures=[arch], intermediate_size=8)
    cfg.update(bad)
    with pytest.raises(ValueError, match=field):
        ModelArgs.from_hf_config(cfg)
    good = ModelArgs.from_hf_config(dict(BASE, architectures=[arch], intermediate_size=8))
    assert good.shared_expert_gate and good.linear_layers == (0,) and good.attention_layers == (1,)
