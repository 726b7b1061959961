"""Pieces shared by the Triton kernels. Imports Triton: import it only where ``gpu_paths.triton_available()``.

``mma(a, b, F32)`` is the kernels' one matrix product, accumulating in float32. With ``F32`` both operands
are taken to float32 and multiplied at full precision (``input_precision="ieee"``: no TF32 rounding, so a
float32 model gets float32 answers). Without it 16-bit operands go to the tensor cores as they are.
``F32`` is also forced under the interpreter, whose ``tl.dot`` multiplies bf16 operands' raw bits as
integers; there the operands are rounded to their 16-bit dtype first, so the interpreter sees the same
inputs a GPU would.
"""

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.gpu_paths import triton_interpreted

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (asked once); 4 elsewhere (the interpreter), so tests still see small
    layers spread over several programs."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def mma(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


def dot_in_f32(dtype: torch.dtype) -> bool:
    """The ``F32`` argument of ``mma`` for operands of ``dtype``."""
    return dtype == torch.float32 or triton_interpreted()


@triton.jit
def round_bf16(x):
    """float32 -> bfloat16, rounding to nearest even (what torch does), through the bits.

    ``x.to(tl.bfloat16)`` rounds so on a GPU but truncates under the interpreter; this is the same on
    both. (A NaN whose mantissa is all ones comes out as infinity; no kernel here produces one.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def narrow(x, like_ptr, BF16: tl.constexpr):
    """float32 ``x`` in the element dtype of ``like_ptr``; ``BF16`` says that dtype is bfloat16."""
    if BF16:
        return round_bf16(x)
    return x.to(like_ptr.dtype.element_ty)


@triton.jit
def cache_codes(x, FP8: tl.constexpr):
    """Loaded cache codes as float32: int8 as is, fp8 e4m3 from its bytes (the cache is passed as uint8)."""
    if FP8:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def tanh32(x):
    """tanh in float32 from ``tl.exp`` alone (the interpreter has no libdevice): below |x| = 0.625 an odd
    polynomial (Cephes' tanhf coefficients), from there (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 (no
    overflow), with x's sign; the form the CPU kernels use (vec.h's v_tanh)."""
    ax = tl.abs(x)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = x + x * z * p
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def key_scores(
    q, q_ptr, k_ptr, ks_ptr, bt_ptr, row, kvh, pos, lo, p_end, d, d_ok, s_bt, s_kb, s_ks, s_kh, s_sb, s_ss,
    max_blocks, scale, softcap,
    QUANT: tl.constexpr, FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr,
    F32: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """One tile of keys at positions ``pos`` of a paged cache [num_blocks, block_size, Hkv, D] (the row's block
    table at ``bt_ptr``; int8 / fp8 codes times their token's scale where ``QUANT``, in float32 then q's dtype,
    as kv_quant.dequantize): the scaled (and soft-capped) scores of the query heads ``q`` against them, and the
    keys' ``visible`` mask ([lo, p_end)), block ids and slots. Scores of invisible keys are left unmasked."""
    visible = (pos >= lo) & (pos < p_end)
    blk_idx = pos // BLOCK_SIZE
    blk = tl.load(bt_ptr + row * s_bt + blk_idx, mask=visible & (blk_idx < max_blocks), other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k = tl.load(
        k_ptr + blk[:, None] * s_kb + slot[:, None] * s_ks + kvh * s_kh + d[None, :],
        mask=visible[:, None] & d_ok[None, :],
        other=0,
    )
    if QUANT:
        k_s = tl.load(ks_ptr + blk * s_sb + slot * s_ss + kvh, mask=visible, other=0.0)
        k = narrow(cache_codes(k, FP8) * k_s[:, None], q_ptr, BF16)
    s = mma(q, tl.trans(k), F32) * scale
    if SOFTCAP:
        s = softcap * tanh32(s / softcap)
    return s, visible, blk, slot
