"""Attention logit soft-capping (Gemma 2: each scaled score ``x`` becomes ``cap * tanh(x / cap)`` before the
softmax) in our CPU decode and prompt attention kernels, against a float32 torch reference; and the kernels'
vectorised tanh against ``torch.tanh``."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import kv_quant
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import paged_attention as decode_kernel
from sidecar.model.kernels.cpu import prefill_attention as prefill_kernel

F32_TOL = 1e-5  # float32: the order of the sums, and tanh within two ulp of libm's
BF16_TOL = 2e-2  # bf16: the output's rounding (and, on CPUs with AVX-512 BF16, the weights rounded to bf16)


def test_tanh_matches_torch_over_a_wide_range():
    x = torch.cat(
        [
            torch.linspace(
                -100.0, 100.0, 200_003
            ),  # past where tanh is +-1 in float32, and where exp would flush
            torch.linspace(-1.0, 1.0, 100_001),  # around the switch between the polynomial and the exp form
            torch.logspace(-30, 1, 997),
            -torch.logspace(-30, 1, 997),
            torch.tensor([0.0, -0.0, 0.625, -0.625, 0.62499994, 43.5, 88.0, float("inf"), float("-inf")]),
        ]
    )
    got = decode_kernel.softcap_(x.clone(), 1.0)
    assert got is not None, cpu_build.reason("paged_attention")
    ref = torch.tanh(x.double())
    err = (got.double() - ref).abs()
    assert err.max() <= 1.2e-7  # under one ulp of 1
    assert (err / ref.abs().clamp(min=1e-38)).max() <= 2.5e-7  # two ulp relative, down to the tiniest x
    assert torch.equal(torch.sign(got), torch.sign(x))  # odd, and exactly 0 at 0
    assert torch.isnan(decode_kernel.softcap_(torch.tensor([float("nan")] * 9), 1.0)).all()
    # the cap as the kernels apply it: cap * tanh(x * scale / cap)
    y = torch.linspace(-400.0, 400.0, 1001)
    capped = decode_kernel.softcap_(y.clone(), 7.5, 0.125)
    assert (capped.double() - 7.5 * torch.tanh(y.double() * 0.125 / 7.5)).abs().max() <= 7.5 * 2.5e-7


def _reference(q, k, v, qpos, scale, window, cap):
    """float32 attention of rows q [R, H, D] at positions qpos [R] over one sequence's keys k, v [N, Hkv, D]:
    row i sees keys max(0, p_i + 1 - window) <= j <= p_i, its scores capped when ``cap``."""
    rep = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(rep, 1)
    v = v.float().repeat_interleave(rep, 1)
    s = torch.einsum("rhd,nhd->rhn", q.float(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    kpos = torch.arange(k.shape[0])[None, :]
    mask = kpos <= qpos[:, None]
    if window:
        mask &= kpos > qpos[:, None] - window
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhn,nhd->rhd", s.softmax(-1), v)


def _pool(num_blocks, bs, nkv, hd, dtype, int8, g):
    """A K/V pool in ``dtype`` (int8 codes with their scales when ``int8``), and its values in float32 as the
    kernels see them."""
    k = torch.randn(num_blocks, bs, nkv, hd, generator=g)
    v = torch.randn(num_blocks, bs, nkv, hd, generator=g)
    if not int8:
        kc, vc = k.to(dtype), v.to(dtype)
        return kc, vc, None, kc.float(), vc.float()
    kc, vc = torch.empty_like(k, dtype=torch.int8), torch.empty_like(v, dtype=torch.int8)
    ks, vs = torch.empty(k.shape[:3]), torch.empty(v.shape[:3])
    kv_quant.write((kc, vc, ks, vs), k.view(-1, nkv, hd), v.view(-1, nkv, hd), torch.arange(num_blocks * bs))
    table = torch.arange(num_blocks)
    kf = kv_quant.gather(kc, ks, table, None, torch.float32).view(num_blocks, bs, nkv, hd)
    vf = kv_quant.gather(vc, vs, table, None, torch.float32).view(num_blocks, bs, nkv, hd)
    return kc, vc, (ks, vs), kf, vf


DECODE_CASES = [
    # ctx_lens, nh, nkv, hd, window
    ([1, 17, 400, 33], 9, 3, 64, None),  # SmolLM2-135M's heads; a context of one key
    ([300, 129, 70], 14, 2, 64, 50),  # 7 queries per KV head (values in grouped passes), a window
    ([90, 91, 5], 8, 8, 128, None),  # no grouping, Llama's head size
    ([260, 40], 8, 1, 256, 33),  # Gemma's head size 256, all heads on one KV head
    ([63, 64, 65], 4, 2, 32, 16),  # a window of one block; head size one AVX-512 vector wide
    ([100, 11], 6, 2, 48, None),  # a head size of three AVX-512 vectors
]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx_lens,nh,nkv,hd,window", DECODE_CASES)
def test_decode_kernel_caps_like_the_reference(ctx_lens, nh, nkv, hd, window, dtype, int8):
    g = torch.Generator().manual_seed(sum(ctx_lens) + hd)
    bs, cap = 16, 5.0
    per_row = [-(-c // bs) for c in ctx_lens]
    num_blocks = sum(per_row) + 3
    kc, vc, scales, kf, vf = _pool(num_blocks, bs, nkv, hd, dtype, int8, g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in per_row:
        tables.append(ids[:n] + [0] * (max(per_row) - n))
        ids = ids[n:]
    tables = torch.tensor(tables)
    q = (torch.randn(len(ctx_lens), nh, hd, generator=g) * 4.0).to(dtype)  # scores well past the cap
    scale = hd**-0.5
    out = decode_kernel.decode_attention(
        q, kc, vc, tables, torch.tensor(ctx_lens), scale, window, scales, cap
    )
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    for b, c in enumerate(ctx_lens):
        rows = tables[b, : per_row[b]]
        k = kf[rows].reshape(-1, nkv, hd)[:c]
        v = vf[rows].reshape(-1, nkv, hd)[:c]
        pos = torch.tensor([c - 1])
        ref = _reference(q[b : b + 1], k, v, pos, scale, window, cap)
        assert (out[b : b + 1].float() - ref).abs().max() <= (F32_TOL if dtype == torch.float32 else BF16_TOL)
        if c > 4:  # the cap changes the answer: the test could not pass without it
            assert (_reference(q[b : b + 1], k, v, pos, scale, window, None) - ref).abs().max() > 0.05


PREFILL_CASES = [
    # rows, ctx, nh, nkv, hd, bs, window
    (37, 37, 14, 2, 64, 16, None),  # a whole prompt, 7 queries per KV head
    (5, 70, 9, 3, 64, 16, None),  # a chunk after 65 cached tokens
    (100, 300, 8, 8, 128, 16, 40),  # no grouping, Llama's head size, a window shorter than the context
    (33, 90, 8, 2, 128, 8, 17),  # small blocks, a window
    (33, 90, 8, 2, 256, 8, 17),  # Gemma's head size 256 (AVX2: the values in two slices of dimensions)
    (64, 64, 32, 1, 32, 32, None),  # 32 query heads on one KV head
    (20, 90, 6, 2, 48, 8, 7),  # a head size of three AVX-512 vectors
]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,ctx,nh,nkv,hd,bs,window", PREFILL_CASES)
def test_prefill_kernel_caps_like_the_reference(rows, ctx, nh, nkv, hd, bs, window, dtype, int8):
    g = torch.Generator().manual_seed(rows + ctx + hd)
    cap = 6.0
    n = -(-ctx // bs)
    kc, vc, scales, kf, vf = _pool(n + 5, bs, nkv, hd, dtype, int8, g)
    table = torch.randperm(n + 5, generator=g)[:n]
    q = (torch.randn(rows, nh, hd, generator=g) * 4.0).to(dtype)
    scale = hd**-0.5
    out = prefill_kernel.prefill_attention(q, kc, vc, table, ctx, scale, window, scales, cap)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    k, v = kf[table].reshape(-1, nkv, hd)[:ctx], vf[table].reshape(-1, nkv, hd)[:ctx]
    pos = torch.arange(ctx - rows, ctx)
    ref = _reference(q, k, v, pos, scale, window, cap)
    assert (out.float() - ref).abs().max() <= (F32_TOL if dtype == torch.float32 else BF16_TOL)
    assert (_reference(q, k, v, pos, scale, window, None) - ref).abs().max() > 0.05


def test_a_capped_row_does_not_depend_on_how_the_prompt_was_split():
    """Chunked prefill with soft-capping reproduces an unchunked run bit for bit, as without it."""
    g = torch.Generator().manual_seed(3)
    kc, vc, _, _, _ = _pool(8, 16, 2, 64, torch.bfloat16, False, g)
    table = torch.randperm(8, generator=g)[:6]
    q = (torch.randn(90, 14, 64, generator=g) * 4.0).bfloat16()
    for window in (None, 10):
        whole = prefill_kernel.prefill_attention(q, kc, vc, table, 90, 0.125, window, None, 3.0)
        parts = [
            prefill_kernel.prefill_attention(q[a:b], kc, vc, table, b, 0.125, window, None, 3.0)
            for a, b in ((0, 13), (13, 50), (50, 90))
        ]
        assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize(
    "arch", ["-mavx2 -mfma", "-mtune=generic", "-march=native -mno-amx-tile -mno-amx-bf16"]
)
def test_other_instruction_sets_cap_too(arch, monkeypatch):
    """AVX2 only (as on Zen 2), plain x86-64 (the decode kernel's scalar loop; the prompt kernel declines), and
    this CPU without AMX (an AVX-512 BF16 CPU then takes bf16 prompts through dot products)."""
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc, _, kf, vf = _pool(12, 16, 2, 64, dtype, False, g)
        table = torch.randperm(12, generator=g)[:8]
        q = (torch.randn(40, 8, 64, generator=g) * 4.0).to(dtype)
        k, v = kf[table].reshape(-1, 2, 64)[:120], vf[table].reshape(-1, 2, 64)[:120]
        pos = torch.arange(80, 120)
        ref = _reference(q, k, v, pos, 0.125, 30, 4.0)
        tol = F32_TOL if dtype == torch.float32 else BF16_TOL
        out = prefill_kernel.prefill_attention(q, kc, vc, table, 120, 0.125, 30, None, 4.0)
        if arch == "-mtune=generic":
            assert out is None
        else:
            assert (out.float() - ref).abs().max() <= tol
        tables = table[None].expand(40, -1).contiguous()
        out = decode_kernel.decode_attention(q, kc, vc, tables, pos + 1, 0.125, 30, None, 4.0)
        assert (out.float() - ref).abs().max() <= tol
