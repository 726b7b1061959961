"""Quantized KV cache (int8 / fp8 codes with a float32 scale per token and KV head): the quantizer's
invariant, and every attention path that reads the codes (our CPU kernel in its AVX-512, AVX2 and plain-C
builds, the torch reference for decode and prefill rows) against float64 attention over the dequantized
cache."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import kv_quant
from sidecar.model.attention import AttentionMetadata, PrefillSegment, paged_attention
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import paged_attention as kernel


def _quant_case(
    ctx_lens, nh, nkv, hd, bs=16, qdtype=torch.float32, kv_dtype=torch.int8, seed=0, magnitude=1.0
):
    """A quantized pool with blocks in shuffled order, and decode rows over it."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-c // bs) for c in ctx_lens]
    width = max(per_row)
    num_blocks = sum(per_row) + 3
    cache = kv_quant.allocate(num_blocks, bs, nkv, hd, kv_dtype, torch.device("cpu"))
    for t in cache:
        t.zero_()
    k = torch.randn(num_blocks * bs, nkv, hd, generator=g) * magnitude
    v = torch.randn(num_blocks * bs, nkv, hd, generator=g) * magnitude
    kv_quant.write(cache, k, v, torch.arange(num_blocks * bs))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in per_row:
        tables.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    q = (torch.randn(len(ctx_lens), nh, hd, generator=g)).to(qdtype)
    return q, cache, torch.tensor(tables), torch.tensor(ctx_lens)


def _reference(q, cache, tables, ctx, scale, window):
    """float64 attention of each row over the dequantized codes (the quantized inputs, exactly)."""
    kc, vc, ks, vs = cache
    bs, nkv, hd = kc.shape[1], kc.shape[2], kc.shape[3]
    rep = q.shape[1] // nkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        lo = max(0, n - window) if window else 0
        blocks = tables[b, : -(-n // bs)]
        k = (kc[blocks].double() * ks[blocks].double()[..., None]).reshape(-1, nkv, hd)[lo:n]
        v = (vc[blocks].double() * vs[blocks].double()[..., None]).reshape(-1, nkv, hd)[lo:n]
        for h in range(q.shape[1]):
            w = torch.softmax(scale * (k[:, h // rep] @ q[b, h].double()), 0)
            out[b, h] = w @ v[:, h // rep]
    return out


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 2e-2


def test_quantizer_invariant_and_zero_and_extreme_rows():
    x = torch.randn(5, 3, 64)
    x[1] = 0.0  # an all-zero row: scale 1, codes 0, no division by zero
    x[2, 0] *= 1e4  # large values
    x[3, 1] *= 1e-6  # tiny values keep their own scale
    q, s = kv_quant.quantize(x, torch.int8)
    assert q.dtype == torch.int8 and s.shape == (5, 3) and s.dtype == torch.float32
    assert int(q.abs().max()) == 127 and torch.all(s[1] == 1.0) and torch.all(q[1] == 0)
    back = kv_quant.dequantize(q, s, torch.float32)
    assert torch.all((back - x).abs() <= s[..., None] / 2 * (1 + 1e-5))
    assert (back[3, 1] - x[3, 1]).abs().max() < 1e-7  # relative precision, not absolute


def test_fp8_codes_round_trip_within_e4m3_precision():
    x = torch.randn(4, 2, 64) * 3
    q, s = kv_quant.quantize(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
    back = kv_quant.dequantize(q, s, torch.float32)
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + s[..., None] * 2**-9)


def test_fp8_on_cpu_falls_back_to_int8_with_a_reason():
    dtype, reason = kv_quant.resolve_kv_dtype("fp8", torch.device("cpu"), torch.bfloat16)
    assert dtype == torch.int8 and "sm89" in reason
    assert kv_quant.resolve_kv_dtype("auto", torch.device("cpu"), torch.bfloat16)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.resolve_kv_dtype("int4", torch.device("cpu"), torch.float32)


def test_block_bytes_round_trip_keeps_codes_and_scales():
    caches = [kv_quant.allocate(4, 16, 2, 32, torch.int8, torch.device("cpu")) for _ in range(3)]
    for layer in caches:
        for t in layer:
            t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    data = kv_quant.read_block(caches, 2)
    assert data.numel() == kv_quant.block_nbytes(caches) == 3 * 2 * (16 * 2 * 32 + 16 * 2 * 4)
    kv_quant.write_block(caches, 3, data)
    for layer in caches:
        for t in layer:
            assert torch.equal(t[3], t[2])
    with pytest.raises(ValueError, match="bytes"):
        kv_quant.write_block(caches, 1, data[:-4])


def test_kernel_builds_on_this_machine():
    assert kernel.available(), cpu_build.reason("paged_attention")


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx_lens,nh,nkv,hd,window",
    [
        ([1], 4, 4, 64, None),  # one key
        ([15, 16, 17, 32, 33], 9, 3, 64, None),  # SmolLM2-135M's heads; lengths on and across block edges
        ([300] * 3 + [129], 14, 2, 64, None),  # 7 queries per KV head
        ([1000, 1001], 8, 2, 128, None),  # Llama's head size
        ([5, 49, 50, 200], 4, 2, 64, 16),  # sliding window
        ([70, 2], 6, 6, 32, None),  # no grouping, a narrow head
    ],
)
def test_cpu_kernel_reads_int8_blocks_like_float64(ctx_lens, nh, nkv, hd, window, qdtype):
    q, cache, tables, ctx = _quant_case(ctx_lens, nh, nkv, hd, qdtype=qdtype, seed=len(ctx_lens) + hd)
    scale = hd**-0.5
    out = kernel.decode_attention(q, cache[0], cache[1], tables, ctx, scale, window, cache[2:])
    assert out is not None and out.dtype == qdtype and out.shape == q.shape
    assert (out.double() - _reference(q, cache, tables, ctx, scale, window)).abs().max() <= _tol(qdtype)


def test_extreme_values_stay_finite():
    q, cache, tables, ctx = _quant_case(
        [40, 40], 2, 1, 64, seed=9, magnitude=100.0
    )  # scores in the thousands
    out = kernel.decode_attention(q, cache[0], cache[1], tables, ctx, 1.0, None, cache[2:])
    ref = _reference(q, cache, tables, ctx, 1.0, None)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() <= 1e-3


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only; plain x86-64 (plain C)
def test_other_instruction_sets_read_int8_blocks(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert kernel.available(), cpu_build.reason("paged_attention")
    for ctx_lens, nh, nkv, hd, window in [
        ([17, 400, 33], 9, 3, 64, None),
        ([90, 91], 8, 2, 128, 40),
        ([3, 64], 2, 2, 24, None),
    ]:
        q, cache, tables, ctx = _quant_case(ctx_lens, nh, nkv, hd, seed=hd)
        out = kernel.decode_attention(q, cache[0], cache[1], tables, ctx, 0.1, window, cache[2:])
        assert out is not None
        assert (out.double() - _reference(q, cache, tables, ctx, 0.1, window)).abs().max() <= 2e-5


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_torch_decode_path_reads_quantized_blocks_like_float64(kv_dtype):
    q, cache, tables, ctx = _quant_case([17, 64, 3, 200], 9, 3, 64, kv_dtype=kv_dtype, seed=3)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=16,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
        use_cpu_kernel=False,
    )
    out = paged_attention(
        q, None, None, cache[0], cache[1], meta, 0.125, None, kv_written=True, kv_scales=cache[2:]
    )
    assert (out.double() - _reference(q, cache, tables, ctx, 0.125, None)).abs().max() <= 2e-5


def test_fp8_cache_is_not_given_to_the_int8_kernel():
    q, cache, tables, ctx = _quant_case([20], 4, 2, 64, kv_dtype=torch.float8_e4m3fn)
    assert kernel.decode_attention(q, cache[0], cache[1], tables, ctx, 0.125, None, cache[2:]) is None


def test_prefill_rows_quantize_on_write_and_attend_through_the_cache():
    """A whole prompt written into an empty quantized cache: each query attends causally to the dequantized
    keys (not the exact ones), the same numbers a later decode row reads."""
    g = torch.Generator().manual_seed(1)
    n, nh, nkv, hd, bs = 37, 4, 2, 64, 16
    cache = kv_quant.allocate(6, bs, nkv, hd, torch.int8, torch.device("cpu"))
    for t in cache:
        t.zero_()
    q, k, v = (torch.randn(n, h, hd, generator=g) for h in (nh, nkv, nkv))
    table = torch.tensor([4, 1, 3])
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])
    meta = AttentionMetadata(slot_mapping=slots, block_size=bs, prefills=[PrefillSegment(0, n, n, table)])
    out = paged_attention(q, k, v, cache[0], cache[1], meta, 0.125, kv_scales=cache[2:])
    ks, vs = kv_quant.quantize(k, torch.int8), kv_quant.quantize(v, torch.int8)
    kd = ks[0].double() * ks[1].double()[..., None]
    vd = vs[0].double() * vs[1].double()[..., None]
    for p in (0, 15, 16, 36):
        for h in range(nh):
            w = torch.softmax(0.125 * (kd[: p + 1, h // 2] @ q[p, h].double()), 0)
            assert (out[p, h].double() - w @ vd[: p + 1, h // 2]).abs().max() <= 2e-5


@pytest.mark.parametrize("arch", [None, "-mavx2 -mfma", "-mtune=generic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_quantizes_on_write_bit_for_bit_as_kv_quant(dtype, arch, monkeypatch):
    """The fused rope + KV write stores the int8 codes and scales kv_quant.write stores for the torch path's
    rope(k) and v (the quantizer is one definition, whichever path writes)."""
    from sidecar.model.kernels.cpu import rope_kv

    if arch:
        monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
        monkeypatch.setattr(cpu_build, "_loaded", {})
    g = torch.Generator().manual_seed(4)
    t, nh, nkv, hd, slots_n = 37, 9, 3, 64, 90
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 4).to(dtype)
    qkv[3, (nh + nkv) * hd : (nh + nkv + 1) * hd] = 0  # an all-zero V row: scale 1
    ang = torch.randn(t, hd // 2, generator=g).repeat(1, 2) * 50
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cos, sin = ang.cos().to(dtype), (ang.sin() * sign).to(dtype)
    slots = torch.randperm(slots_n, generator=g)[:t]
    cache = kv_quant.allocate(slots_n, 1, nkv, hd, torch.int8, torch.device("cpu"))
    for x in cache:
        x.zero_()
    ref = tuple(x.clone() for x in cache)
    out = rope_kv.rope_store_kv(
        qkv, cos, sin, slots, cache[0], cache[1], nh, nkv, hd, True, kv_scales=cache[2:]
    )
    assert out is not None
    nqk = (nh + nkv) * hd
    qk = qkv[:, :nqk].view(t, nh + nkv, hd)
    qk = qk * cos[:, None, :] + torch.roll(qk, hd // 2, dims=-1) * sin[:, None, :]
    kv_quant.write(ref, qk[:, nh:], qkv[:, nqk:].view(t, nkv, hd), slots)
    assert torch.equal(out[0], qk[:, :nh]) and torch.equal(out[1], qk[:, nh:])
    for got, want in zip(cache, ref):
        assert torch.equal(got, want)
    # An fp8 cache is not the kernel's: the caller's torch path writes it.
    fp8 = kv_quant.allocate(slots_n, 1, nkv, hd, torch.float8_e4m3fn, torch.device("cpu"))
    assert (
        rope_kv.rope_store_kv(qkv, cos, sin, slots, fp8[0], fp8[1], nh, nkv, hd, True, kv_scales=fp8[2:])
        is None
    )
