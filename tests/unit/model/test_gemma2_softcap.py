"""Gemma 2's soft-caps through the engine on our kernels: a tiny random Gemma 2 checkpoint whose attention
scores go well past a small cap (its query and key projections scaled up) is greedy float32 equal to HF
transformers token for token with its decode rows in the C kernel, under preemption (a tight pool) and
chunked prefill (a small token budget); bf16 prompts take the C prompt kernel with the cap; and the final
logit cap holds on every head we build (float32, bf16, int8 and int4 weights)."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import attention
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint

ATTN_CAP, FINAL_CAP = 5.0, 8.0
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# windows of 8 tokens: prompts inside one and well past it
PROMPTS = [[5 + (11 * i + 5 * j) % 800 for j in range(n)] for i, n in enumerate([3, 9, 30, 41, 14, 22])]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, demo_dir):
    """Gemma 2 with a head size our kernels take on every ISA (32), its attention cap at ATTN_CAP and q / k
    projections scaled so that scores pass it by far; the head untied (a tiny random model with a tied one
    repeats one token, which a wrong attention would repeat too)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gemma2cap") / "gemma2"
    build_family_checkpoint(
        "gemma2",
        out,
        demo_dir,
        seed=7,
        head_dim=32,
        attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP,
        tie_word_embeddings=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(1.5)
            layer.self_attn.k_proj.weight.mul_(1.5)
    hf.save_pretrained(out, safe_serialization=True)
    return out


def _spy(monkeypatch, module, name: str) -> list:
    """Records (softcap, whether the kernel took the call) for every call of ``module.name``."""
    seen = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((args[-1], out is not None))
        return out

    monkeypatch.setattr(module, name, spy)
    return seen


def test_the_cap_matters_here(gemma2_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(gemma2_dir))
    assert cfg.attn_logit_softcapping == ATTN_CAP and cfg.head_dim == 32
    uncapped = gemma2_dir.parent / "uncapped"
    if not uncapped.exists():
        import shutil

        shutil.copytree(gemma2_dir, uncapped)
        cfg.attn_logit_softcapping = None
        cfg.save_pretrained(uncapped)
    assert hf_greedy(uncapped, PROMPTS, MAX_NEW) != hf_greedy(gemma2_dir, PROMPTS, MAX_NEW)


def test_the_decode_kernels_cap_matters_here(gemma2_dir, monkeypatch):
    """The engine's answer depends on the decode kernel capping: with the cap dropped there, it is not HF's."""
    real = attention.cpu_kernel.decode_attention
    monkeypatch.setattr(attention.cpu_kernel, "decode_attention", lambda *a, **k: real(*a[:-1], None, **k))
    llm = LLM(model=str(gemma2_dir), dtype="float32")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != hf_greedy(gemma2_dir, PROMPTS, MAX_NEW)


def test_greedy_matches_hf_on_the_c_decode_kernel(gemma2_dir, monkeypatch):
    ref = hf_greedy(gemma2_dir, PROMPTS, MAX_NEW)
    seen = _spy(monkeypatch, attention.cpu_kernel, "decode_attention")
    # 13 usable blocks of 8 tokens cannot hold the 6 requests (up to 53 tokens each) at once; 16 tokens a step
    # split the longer prompts into chunks.
    llm = LLM(
        model=str(gemma2_dir), dtype="float32", block_size=8, num_kv_blocks=14, max_num_batched_tokens=16
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert seen and all(cap == ATTN_CAP and taken for cap, taken in seen)  # every decode row in the C kernel
    assert_pool_whole(llm)


def test_bf16_prompts_take_the_c_prompt_kernel_with_the_cap(gemma2_dir, monkeypatch):
    prompt_calls = _spy(monkeypatch, attention.prefill_kernel, "prefill_attention")
    decode_calls = _spy(monkeypatch, attention.cpu_kernel, "decode_attention")
    llm = LLM(model=str(gemma2_dir), dtype="bfloat16", block_size=8, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, GREEDY)
    assert prompt_calls and all(cap == ATTN_CAP and taken for cap, taken in prompt_calls)
    assert decode_calls and all(cap == ATTN_CAP and taken for cap, taken in decode_calls)
    ref = hf_greedy(gemma2_dir, PROMPTS, 1)
    assert sum(o.token_ids[0] == r[0] for o, r in zip(outs, ref)) >= len(PROMPTS) // 2
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "dtype,quant",
    [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4"), ("bfloat16", "int8")],
)
def test_final_cap_on_every_head(gemma2_dir, dtype, quant):
    """compute_logits caps whatever head produced the logits: our float32 / bf16 linears (C kernels) and the
    quantized heads. The head's raw logits pass the cap, so an
    uncapped head would show."""
    from sidecar.config import EngineConfig
    from sidecar.model.loader import load_model

    cfg = EngineConfig(
        model=str(gemma2_dir),
        dtype=dtype,
        quantization=quant,
        quant_group_size=32,
        quantize_lm_head=bool(quant),
    )
    model = load_model(cfg).model
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(3, model.args.hidden_size, generator=g) * 4).to(getattr(torch, dtype))
    with torch.no_grad():
        logits = model.compute_logits(hidden)
        raw = model.lm_head(hidden).float()
    assert logits.dtype == torch.float32
    assert raw.abs().max() > 2 * FINAL_CAP and logits.abs().max() <= FINAL_CAP
    tol = 1e-5 if dtype == "float32" else 0.1  # bf16: the head's own product may round otherwise than forward
    assert (logits - FINAL_CAP * torch.tanh(raw / FINAL_CAP)).abs().max() <= tol * FINAL_CAP


def test_the_self_check_keeps_the_capped_triton_kernel_and_it_matches_hf(gemma2_dir, monkeypatch):
    """The Triton decode kernel caps too (in the interpreter on CPU, as on a GPU): the start-up self-check
    keeps it on for Gemma 2, and greedy float32 with every decode row through it is HF's."""
    from sidecar.engine import self_check
    from sidecar.model.kernels.triton import attention as triton_attention

    ref = hf_greedy(gemma2_dir, PROMPTS[:3], 6)
    llm = LLM(model=str(gemma2_dir), dtype="float32", num_kv_blocks=40)
    seen = []
    real = triton_attention.paged_decode_attention
    monkeypatch.setattr(
        triton_attention,
        "paged_decode_attention",
        lambda qd, *a, **k: seen.append(k.get("softcap")) or real(qd, *a, **k),
    )
    assert self_check.run(llm.engine.runner, ["attention"]) == {}
    assert llm.engine.runner.fast_paths.attention and seen and set(seen) == {ATTN_CAP}
    seen.clear()
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert seen and set(seen) == {ATTN_CAP}
