"""DeepSeek V3 on CUDA: the latent-attention decode rows run on the Triton kernel
(kernels/triton/latent_attention.py), which passed its start-up self-check there, replayed from decode graphs
as well as eager; greedy float32 equal to HF transformers token for token, the KV blocks all back after. The
kernel at DeepSeek V3's latent widths (rank 512, rotary 64, 128 heads) over long contexts, across its context
partitions, against the torch form on CPU."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import mla
from sidecar.model.attention import AttentionMetadata
from sidecar.model.kernels.triton import latent_attention as kernel
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.latent_checkpoints import build_latent_checkpoint

NEW = 8
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 30, 45, 1])]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_deepseek_widths_match_the_torch_form(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    bs, nblocks, ctx = 16, 160, torch.tensor([1, 17, 700, 2000])
    tables = torch.stack([torch.randperm(nblocks, generator=gen)[:128] for _ in range(4)])
    kv = tuple(torch.randn(nblocks, bs, 1, w, generator=gen).to(dtype) for w in (512, 64))
    q_lat, q_rope = ((torch.randn(4, 128, w, generator=gen) * 0.1).to(dtype) for w in (512, 64))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=bs,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
    )
    want = mla.torch_decode(q_lat, q_rope, kv, meta, 0.07)
    got = kernel.decode_attention(*(x.cuda() for x in (q_lat, q_rope, *kv, tables, ctx)), 0.07)
    assert got is not None
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("eager", [True, False])
def test_deepseek_decode_on_the_triton_kernel_matches_hf(tmp_path, demo_dir, monkeypatch, eager):
    import transformers as tf

    path = build_latent_checkpoint("deepseek_v3", tmp_path / "ds", demo_dir)
    want = hf_generate(tf.DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32), PROMPTS, NEW)
    assert_not_degenerate(want)
    calls = []
    decode = kernel.decode_attention

    def counted(*args, **kw):
        out = decode(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernel, "decode_attention", counted)  # counts the kernel's launches, still runs it
    llm = LLM(model=str(path), dtype="float32", device="cuda", block_size=8, enforce_eager=eager)
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    assert got == want
    assert mla.triton_ready(torch.device("cuda")), mla._triton_checked
    assert calls and all(calls)
    assert_pool_whole(llm)
