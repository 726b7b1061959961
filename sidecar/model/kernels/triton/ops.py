"""The decoder's elementwise steps as Triton kernels, each with the semantics of its CPU twin.

- ``rope_store_kv(qkv, cos, sin, slots, k_cache, v_cache, nh, nkv, hd, want_k)``: as
  ``rope_kv.rope_store_kv``: rotary embedding of q and k out of the fused qkv projection [T, (nh+2nkv) hd]
  (rotate-half's sign folded into ``sin``), rope(k) and v written to the caches at ``slots``; returns
  ``(q [T, nh, hd], k [T, nkv, hd] or None, v view of qkv)``. A negative slot writes nothing (a padded
  row of a fixed-size batch). With ``kv_scales`` (an int8 or fp8 e4m3 cache) rope(k) and v are quantized
  on write, bit for bit as ``kv_quant.write``.
- ``add_rms_norm(h, delta, weight, eps)``: as ``norm_act.add_rms_norm``: ``s = h + delta`` (``h`` without
  a delta), returns ``(weight * rms_norm(s), s)``.
- ``silu_mul(gu)``: as ``norm_act.silu_mul``: ``silu(gate) * up`` over [T, 2I] -> [T, I].

Each rounds where torch's unfused ops round (after every product and sum in the model dtype; the norm
in float32, cast to the model dtype before the weight, as Hugging Face does), so they differ from the
torch references only by the GPU's exp / rsqrt and the order of the norm's sum: they are compiled
without fused multiply-adds (``enable_fp_fusion=False``), so a product and the sum after it round
separately, as torch's separate ops do.
Every wrapper returns None for inputs it does not take (another dtype, a non-contiguous tensor); the
caller then runs the torch path. Imports Triton: import only where ``gpu_paths.triton_available()``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import narrow

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round_half_even(y):
    fl = tl.floor(y)
    frac = y - fl
    odd = fl - 2.0 * tl.floor(fl * 0.5)  # 1 for an odd floor, else 0
    return tl.where(frac > 0.5, fl + 1.0, tl.where(frac < 0.5, fl, fl + odd))


@triton.jit
def _e4m3_bits(y):
    """float32 ``y`` with |y| <= 448 -> the byte of its float8 e4m3fn value, rounded to nearest even as torch's
    conversion rounds (subnormals included), from the bits: the interpreter has no fp8 type."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = bits & 0x7FFFFFFF
    # Normal (|y| >= 2^-6): round the 23-bit mantissa to 3 at bit 20 (a carry moves into the exponent), rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: multiples of 2^-9, rounded half to even (8 of them is the smallest normal, code 8: the same byte).
    sub = _round_half_even(tl.abs(y) * 512.0).to(tl.uint32)
    return (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _store_codes(c_ptr, s_ptr, slot, h, x, d, ok, NKV: tl.constexpr, HD: tl.constexpr, FP8: tl.constexpr):
    """Codes and scale of one row, as ``kv_quant.quantize``: s = max|x| / QMAX (1 for a zero row); int8:
    codes = round-half-even(x / s) in [-127, 127]; fp8 (``c_ptr`` the cache's bytes): x / s clamped to
    +-448 in e4m3, rounded to nearest even. IEEE divisions, so the codes are torch's bit for bit."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.where(ok, tl.abs(xf), 0.0), 0)
    scale = tl.math.div_rn(amax, 448.0 if FP8 else 127.0)
    scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(xf, scale)
    at = c_ptr + slot * (NKV * HD) + h * HD + d
    if FP8:
        tl.store(at, _e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0)), mask=ok)
    else:
        r = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)
        tl.store(at, r.to(tl.int8), mask=ok)
    tl.store(s_ptr + slot * NKV + h, scale)


@triton.jit
def _rope_kv(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    q_ptr,
    k_ptr,
    s_qkv,
    s_kc_slot,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    HD: tl.constexpr,
    D_PAD: tl.constexpr,
    WANT_K: tl.constexpr,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
    BF16: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads of the fused projection
    d = tl.arange(0, D_PAD)
    ok = d < HD
    row = qkv_ptr + t.to(tl.int64) * s_qkv + head * HD
    x = tl.load(row + d, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if head < NH + NKV:
        # roll(x, HD/2)[d] == x[(d + HD/2) % HD]; sin carries rotate_half's sign.
        partner = tl.load(row + (d + HD // 2) % HD, mask=ok, other=0.0)
        c = tl.load(cos_ptr + t * HD + d, mask=ok, other=0.0)
        s = tl.load(sin_ptr + t * HD + d, mask=ok, other=0.0)
        a = narrow(x.to(tl.float32) * c.to(tl.float32), qkv_ptr, BF16)
        b = narrow(partner.to(tl.float32) * s.to(tl.float32), qkv_ptr, BF16)
        y = narrow(a.to(tl.float32) + b.to(tl.float32), qkv_ptr, BF16)
        if head < NH:
            tl.store(q_ptr + (t * NH + head) * HD + d, y, mask=ok)
        else:
            kh = head - NH
            if slot >= 0:
                if QUANT:
                    _store_codes(kc_ptr, ks_ptr, slot, kh, y, d, ok, NKV, HD, FP8)
                else:
                    tl.store(kc_ptr + slot * s_kc_slot + kh * HD + d, y, mask=ok)
            if WANT_K:
                tl.store(k_ptr + (t * NKV + kh) * HD + d, y, mask=ok)
    elif slot >= 0:
        if QUANT:
            _store_codes(vc_ptr, vs_ptr, slot, head - NH - NKV, x, d, ok, NKV, HD, FP8)
        else:
            tl.store(vc_ptr + slot * s_kc_slot + (head - NH - NKV) * HD + d, x, mask=ok)


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    nh: int,
    nkv: int,
    hd: int,
    want_k: bool,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    dtype = qkv.dtype
    if (
        dtype not in _DTYPES
        or hd % 2
        or qkv.dim() != 2
        or qkv.shape[1] != (nh + 2 * nkv) * hd
        or qkv.stride(1) != 1
    ):
        return None
    t = qkv.shape[0]
    quant = kv_scales is not None
    fp8 = quant and k_cache.dtype == torch.float8_e4m3fn
    if quant and (
        k_cache.dtype not in (torch.int8, torch.float8_e4m3fn)
        or any(
            x.dtype != torch.float32 or not x.is_contiguous() or x.shape != k_cache.shape[:-1]
            for x in kv_scales
        )
    ):
        return None
    cache_dtype = k_cache.dtype if quant else dtype
    if (
        any(x.dtype != dtype or not x.is_contiguous() for x in (cos, sin))
        or any(x.dtype != cache_dtype or not x.is_contiguous() for x in (k_cache, v_cache))
        or cos.numel() != t * hd
        or sin.numel() != t * hd
        or slots.dtype not in (torch.int32, torch.int64)
        or slots.shape != (t,)
        or k_cache.shape != v_cache.shape
        or k_cache.shape[-2:] != (nkv, hd)
    ):
        return None
    q = torch.empty(t, nh, hd, dtype=dtype, device=qkv.device)
    k = torch.empty(t, nkv, hd, dtype=dtype, device=qkv.device) if want_k else None
    if t:
        ks, vs = kv_scales if quant else (q, q)  # unused without QUANT
        kc, vc = (
            (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
        )  # the bytes
        _rope_kv[(t, nh + 2 * nkv)](
            qkv,
            cos,
            sin,
            slots.contiguous(),
            kc,
            vc,
            ks,
            vs,
            q,
            q if k is None else k,
            qkv.stride(0),
            nkv * hd,
            NH=nh,
            NKV=nkv,
            HD=hd,
            D_PAD=triton.next_power_of_2(hd),
            WANT_K=want_k,
            QUANT=quant,
            FP8=fp8,
            BF16=dtype == torch.bfloat16,
            enable_fp_fusion=False,
        )
    return q, k, qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)


@triton.jit
def _add_rms_norm(
    h_ptr,
    d_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    dim,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * dim
    i = tl.arange(0, BLOCK)
    ok = i < dim
    x = tl.load(h_ptr + row + i, mask=ok, other=0.0)
    if HAS_DELTA:
        x = narrow(
            x.to(tl.float32) + tl.load(d_ptr + row + i, mask=ok, other=0.0).to(tl.float32), h_ptr, BF16
        )
        tl.store(s_ptr + row + i, x, mask=ok)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
    n = narrow(xf * r, h_ptr, BF16)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + row + i, narrow(w.to(tl.float32) * n.to(tl.float32), h_ptr, BF16), mask=ok)


def add_rms_norm(
    h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    tensors = (h, weight) if delta is None else (h, weight, delta)
    if (
        h.dtype not in _DTYPES
        or h.dim() != 2
        or weight.shape != (h.shape[1],)
        or any(t.dtype != h.dtype or not t.is_contiguous() for t in tensors)
        or (delta is not None and delta.shape != h.shape)
    ):
        return None
    rows, dim = h.shape
    out = torch.empty_like(h)
    s = h if delta is None else torch.empty_like(h)
    block = triton.next_power_of_2(dim)
    if rows:
        _add_rms_norm[(rows,)](
            h,
            h if delta is None else delta,
            weight,
            s,
            out,
            dim,
            float(eps),
            HAS_DELTA=delta is not None,
            BLOCK=block,
            BF16=h.dtype == torch.bfloat16,
            num_warps=8 if block >= 4096 else 4,  # wide rows: fewer values per thread
            enable_fp_fusion=False,
        )
    return out, s


@triton.jit
def _silu_mul(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < inter
    g = tl.load(gu_ptr + row * 2 * inter + i, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + i, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = narrow(gf / (1.0 + tl.exp(-gf)), gu_ptr, BF16)
    tl.store(out_ptr + row * inter + i, narrow(act.to(tl.float32) * u.to(tl.float32), gu_ptr, BF16), mask=ok)


def silu_mul(gu: torch.Tensor) -> Optional[torch.Tensor]:
    if gu.dtype not in _DTYPES or gu.dim() != 2 or gu.shape[1] % 2 or not gu.is_contiguous():
        return None
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if rows and inter:
        _silu_mul[(rows, triton.cdiv(inter, block))](
            gu, out, inter, BLOCK=block, BF16=gu.dtype == torch.bfloat16, enable_fp_fusion=False
        )
    return out
