"""Llama 4 checkpoints (llama4_checkpoints.py) through the engine: greedy float32 equal to HF transformers
``generate`` token for token, with prompts and generations longer than the attention chunk, a tight pool
(preemption), a small token budget (chunked prefill across chunk edges) and prefix-cache hits; the text model
of a vision-language checkpoint against HF's own ``Llama4ForConditionalGeneration``; bf16 on the CPU kernels,
its rope HF's to the bit and its prompt log-probabilities close to HF's in bf16;
the Triton paths (interpreter on CPU) against the paths off; the parameter count against HF's."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.loader import load_model
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.llama4_checkpoints import KINDS, build_llama4_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# Chunks are 16 and 12 tokens: prompts inside the first chunk, at its edge, and across two and three edges.
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 40, 14, 22, 16])]


@pytest.fixture(scope="module")
def llama4_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("llama4")
    return {k: build_llama4_checkpoint(k, root / k, demo_dir) for k in KINDS}


def _hf(model_dir, kind: str):
    """HF's text model of the checkpoint: ``Llama4ForCausalLM``, or the ``language_model`` of a
    ``Llama4ForConditionalGeneration`` (whose own forward needs image inputs in this transformers)."""
    import transformers as tf

    if kind == "llama4_vl":
        hf = tf.Llama4ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        hf = hf.language_model
    else:
        hf = tf.Llama4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    return hf


# llama4_k2 takes the four longest prompts: still more than the pool holds at once
@pytest.mark.parametrize("kind,prompts", [("llama4", PROMPTS), ("llama4_k2", PROMPTS[2:6])])
def test_greedy_matches_hf_with_preemption_chunking_and_prefix_hits(llama4_dirs, kind, prompts):
    ref = hf_generate(_hf(llama4_dirs[kind], kind), prompts, MAX_NEW)
    assert_not_degenerate(ref)  # else equality would not exercise the layers
    # 29 usable blocks of 8 tokens cannot hold the 7 requests (up to 52 tokens each) at once; 16-token
    # prefill chunks end inside and at the attention chunks' edges. A block pages one layer's KV group
    # (engine/kv_groups.py: three chunked groups and a full one), so 30 of them are the bytes of 8 four-layer
    # blocks, and the chunked groups give back what their chunk has passed.
    llm = LLM(
        model=str(llama4_dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=30,
        max_num_batched_tokens=16,
    )
    args = llm.engine.loaded.args
    assert args.nope_layers == (2,) and args.chunk(0) == (12 if kind == "llama4_k2" else 16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)
    longest = prompts.index(PROMPTS[3])
    first, again = (llm.generate([PROMPTS[3]], GREEDY)[0] for _ in range(2))  # again: from the prefix cache
    assert first.token_ids == again.token_ids == ref[longest]
    assert again.num_cached_tokens >= 32
    assert_pool_whole(llm)


def test_a_vision_language_checkpoint_serves_its_text_model(llama4_dirs):
    ref = hf_generate(_hf(llama4_dirs["llama4_vl"], "llama4_vl"), PROMPTS[3:4], MAX_NEW)
    llm = LLM(model=str(llama4_dirs["llama4_vl"]), dtype="float32", block_size=8, max_num_batched_tokens=16)
    assert llm.engine.loaded.args.checkpoint_prefix == "language_model.model."
    assert [o.token_ids for o in llm.generate(PROMPTS[3:4], GREEDY)] == ref


def test_parameter_count_is_hf_s(llama4_dirs):
    from sidecar.model.param_count import parameter_counts

    hf = _hf(llama4_dirs["llama4"], "llama4")
    args = load_model(EngineConfig(model=str(llama4_dirs["llama4"]), dtype="float32"), pack=False).args
    assert parameter_counts(args)[0] == sum(p.numel() for p in hf.parameters())


def test_bf16_runs_on_the_cpu_kernels(llama4_dirs):
    model = str(llama4_dirs["llama4"])
    llm = LLM(model=model, dtype="bfloat16", block_size=8)
    prompts = PROMPTS[1:5]
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    f32 = LLM(model=model, dtype="float32", block_size=8).generate(prompts, GREEDY)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(outs, f32)) >= len(prompts) // 2
    info = llm.engine.model_info
    # the interleaved rope and the q/k L2 norms run as torch operators: the C replay refuses the step and
    # says why rather than replaying a step it did not record
    assert info["cpu_decode_replay"] is False and info["cpu_decode_replay_reason"]
    assert_pool_whole(llm)


def test_triton_paths_match_the_paths_off(llama4_dirs, monkeypatch):
    from tests.unit.model.kernels.triton.test_triton_model import _run, _set

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(
        EngineConfig(model=str(llama4_dirs["llama4"]), dtype="float32", device=device.type), pack=False
    ).model
    ref = _run(model, device)
    _set(model.fast_paths, True)
    fast = _run(model, device)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))


def test_int8_weights_and_int8_kv_agree_with_the_float_path(llama4_dirs):
    from tests.unit.server.test_kv_cache_dtype import prompts

    model, ps = str(llama4_dirs["llama4"]), prompts(12, seed=3)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def first_tokens(**kw) -> list[int]:
        llm = LLM(model=model, dtype="float32", num_kv_blocks=64, **kw)
        return [o.token_ids[0] for o in llm.generate(ps, one)]

    ref = first_tokens()
    # the bar of test_quant_model on random weights; the experts, the shared one too, are quantized
    for kw in (dict(quantization="int8", quant_group_size=32), dict(kv_cache_dtype="int8")):
        assert sum(a == b for a, b in zip(ref, first_tokens(**kw))) / len(ps) >= 0.8, kw


def test_ngram_speculation_equals_plain_greedy(llama4_dirs):
    """Verification rows cross chunk edges and carry the NoPE temperature of their own positions."""
    import random

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 900) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    d = str(llama4_dirs["llama4"])
    plain = [o.token_ids for o in LLM(model=d, dtype="float32", block_size=8).generate(prompts, greedy)]
    llm = LLM(
        model=d,
        dtype="float32",
        speculative="ngram",
        speculative_token_cost=0.0,  # verify every proposal: the most verification rows
        block_size=8,
        max_num_batched_tokens=64,
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    s = llm.stats()
    assert s["spec_decode_verifications"] > 0 and s["spec_decode_accepted_tokens"] > 0
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "field,value",
    [("attention_chunk_size", 0), ("no_rope_layers", [1, 0]), ("hidden_act", "gelu")],
)
def test_a_bad_config_is_refused_naming_the_field(field, value):
    from sidecar.model.args import ModelArgs
    from tests.unit.model.llama4_checkpoints import _text_config

    cfg = dict(_text_config("llama4", 1000).to_dict(), architectures=["Llama4ForCausalLM"])
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        ModelArgs.from_hf_config(cfg)


def test_bf16_rope_is_hf_s_to_the_bit(llama4_dirs):
    """HF's complex rope keeps its table and product in float32 in a bf16 model; ours gives the same bits."""
    import transformers as tf
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding, apply_rotary_emb

    from sidecar.model.attention_local import rotate_interleaved

    d = llama4_dirs["llama4"]
    model = load_model(EngineConfig(model=str(d), dtype="bfloat16"), pack=False).model
    assert model.rope_cos.dtype == torch.float32
    cfg = tf.AutoConfig.from_pretrained(str(d))
    hd = cfg.head_dim
    pos = torch.tensor([0, 1, 7, 30, 200, 255])
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(len(pos), cfg.num_attention_heads, hd, generator=g) * 3).to(torch.bfloat16)
    k = (torch.randn(len(pos), cfg.num_key_value_heads, hd, generator=g) * 3).to(torch.bfloat16)
    cis = Llama4TextRotaryEmbedding(cfg)(q, pos[None])
    want_q, want_k = apply_rotary_emb(q[None], k[None], cis)
    cos, sin = model.rope_rows(pos)
    assert torch.equal(rotate_interleaved(q, cos[0], sin[0]), want_q[0])
    assert torch.equal(rotate_interleaved(k, cos[0], sin[0]), want_k[0])


def test_bf16_prompt_logprobs_are_close_to_hf_s_in_bf16(llama4_dirs):
    """bf16 has no defined exact result (the GEMMs sum in other orders): the prompt tokens' log-probabilities
    in bf16 stay closer to HF's in bf16 than HF's own bf16 ones are to its float32 ones."""
    d, prompts = llama4_dirs["llama4"], PROMPTS[2:4]
    hf32 = _hf(d, "llama4")
    hf16 = _hf(d, "llama4").to(torch.bfloat16)
    llm = LLM(model=str(d), dtype="bfloat16", block_size=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    ours, bf16, f32 = [], [], []
    for p, o in zip(prompts, outs):
        for hf, into in ((hf16, bf16), (hf32, f32)):
            with torch.no_grad():
                logits = hf(torch.tensor([p])).logits[0].float()
            into.append(torch.log_softmax(logits, -1)[torch.arange(len(p) - 1), torch.tensor(p[1:])])
        ours.append(torch.tensor(o.prompt_logprobs[1:]))  # the first token has none
    ours, bf16, f32 = torch.cat(ours), torch.cat(bf16), torch.cat(f32)
    assert ours.shape == bf16.shape
    floor = (bf16 - f32).abs()  # what bf16 alone moves them on this model
    assert (ours - bf16).abs().mean() <= floor.mean() and (ours - bf16).abs().max() <= floor.max()
