"""The Triton latent-attention decode kernel (kernels/triton/latent_attention.py) against mla.py's torch form
(``torch_decode``): contexts across block edges and context partitions (merged), head counts under and past
a head group, float32 and bf16 caches, a row of context 0; the inputs it refuses; its start-up self-check;
and a tiny DeepSeek V3's decode rows through it equal to HF transformers' greedy float32 token for token."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import mla
from sidecar.model.attention import AttentionMetadata
from sidecar.model.kernels.triton import latent_attention as kernel
from tests.unit.engine.test_engine_vs_hf import hf_generate
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.kernels.test_kernel_latent_attention import BS, _case
from tests.unit.model.latent_checkpoints import build_latent_checkpoint


def _torch(ql, qr, kv, tables, ctx, scale):
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=BS,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
    )
    return mla.torch_decode(ql, qr, kv, meta, scale)


def test_self_check_passes(device):
    assert mla.triton_check(kernel.decode_attention, str(device)) == ""
    assert mla.triton_check(kernel.decode_attention, str(device), parts=3) == ""  # partitions merged
    assert mla.triton_ready(device)


@pytest.mark.parametrize(
    "heads,dtype,parts", [(1, torch.float32, 4), (20, torch.float32, 1), (20, torch.bfloat16, 3)]
)
def test_kernel_matches_the_torch_form(heads, dtype, parts, device):
    ql, qr, kv, tables, ctx = _case(heads, 48, 16, dtype, seed=heads)
    want = _torch(ql, qr, kv, tables, ctx, 0.125)
    on = (x.to(device) for x in (ql, qr, *kv, tables, ctx))
    got = kernel.decode_attention(*on, 0.125, parts=parts)
    assert got is not None and got.dtype == dtype and got.shape == want.shape and got.device == device
    # float32: the order of the sums differs; bf16: torch rounds the scores and the weights, the kernel
    # the weights only
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)


def test_a_row_of_no_context_comes_out_zero(device):
    ql, qr, kv, tables, ctx = _case(3, 32, 16, torch.float32)
    ctx[2] = 0  # a padded graph row
    got = kernel.decode_attention(*(x.to(device) for x in (ql, qr, *kv, tables, ctx)), 0.3, parts=2)
    assert torch.equal(got[2].cpu(), torch.zeros_like(got[2].cpu()))
    want = _torch(ql[:2], qr[:2], kv, tables[:2], ctx[:2], 0.3)
    torch.testing.assert_close(got[:2].cpu(), want, atol=1e-5, rtol=1e-5)


def test_inputs_it_cannot_take_are_refused(device):
    ql, qr, kv, tables, ctx = (
        x.to(device) if torch.is_tensor(x) else x for x in _case(2, 32, 16, torch.float32)
    )
    lc, rc = (x.to(device) for x in kv)
    f = kernel.decode_attention
    assert f(ql.half(), qr, lc.half(), rc.half(), tables, ctx, 0.3) is None  # float16
    assert f(ql, qr, lc.bfloat16(), rc, tables, ctx, 0.3) is None  # a cache of another dtype
    assert f(ql, qr, lc, rc, tables.int(), ctx, 0.3) is None  # int32 tables
    assert f(ql, qr, lc, rc, tables, ctx, 0.3, parts=0) is None  # no partition
    wide = torch.zeros(lc.shape[0], BS, 1, kernel.MAX_RANK, device=device)
    big = torch.zeros(ql.shape[0], 2, kernel.MAX_RANK, device=device)  # R + P past a program's tiles
    assert f(big, qr, wide, rc, tables, ctx, 0.3) is None
    assert f(ql, qr, lc, rc, tables, ctx, 0.3) is not None  # the same inputs otherwise taken


PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 20, 1])]
NEW = 5


def test_deepseek_decode_through_the_kernel_matches_hf(tmp_path, demo_dir, monkeypatch, device):
    import transformers as tf

    path = build_latent_checkpoint("deepseek_v3", tmp_path / "ds", demo_dir)
    want = hf_generate(tf.DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32), PROMPTS, NEW)
    assert_not_degenerate(want)
    assert mla.triton_ready(device)  # the self-check's own rows done before counting
    rows = []
    decode = kernel.decode_attention

    def counted(q_lat, *args):
        out = decode(q_lat, *args)
        rows.append(None if out is None else q_lat.shape[0])
        return out

    monkeypatch.setattr(kernel, "decode_attention", counted)  # counts the kernel's calls, still runs it
    mla.use_triton_on_cpu(True)
    try:
        llm = LLM(model=str(path), dtype="float32", device=device.type, enforce_eager=True, block_size=8)
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    finally:
        mla.use_triton_on_cpu(False)
    assert got == want
    # every decode step of every latent layer ran on the kernel, a batch of all three rows included
    assert rows and None not in rows and max(rows) == len(PROMPTS)
