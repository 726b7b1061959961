"""One decode step of a gated DeltaNet layer in Triton (the GPU form of ``kernels/cpu/deltanet_step.c``):
for a batch of sequences, one token each, each in its own state slot, two launches:

  ``_conv``:  per (row, block of channels): the depthwise convolution of the q, k, v channels over the
              slot's window and the row's input, rounded to the dtype, silu, rounded (torch's rounding);
              the window shifted in place to end with the input. Its output ``y`` [n, conv_dim] is scratch.
  ``_rule``:  per (row, value head): q, k L2-normed per key head (q divided by sqrt(k_dim)), value head h
              reading key head h // (v_heads // k_heads); beta = sigmoid(b) rounded to the dtype, g = A *
              softplus(a + dt_bias); ``S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  o = S^T q`` over the
              slot's float32 state [k_dim, v_dim] in place; then the gated norm
              ``norm_w * rms_norm(o) * silu(z)`` rounded where the torch reference rounds.

The convolution is its own launch because value heads that share a key head read the same q, k channels:
one program per head cannot shift a window others still read. Both kernels take device tensors only (no
host reads, no syncs), so a CUDA graph captures them. The rule has no matrix product (sums of elementwise
products, in float32), so no tensor-core precision question arises; it runs without fused multiply-adds
(``enable_fp_fusion=False``), so the decayed state and its update round as torch's separate ops do.

Slots are the engine's (distinct, inside the state); a slot outside the state is masked off (its row is
neither read nor written) rather than checked, which would need a host read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import narrow

MAX_DIM = 256  # bound on k_dim and v_dim: a program holds a [k_dim, v_dim] float32 state tile
CONV_BLOCK = 256  # channels per convolution program


@triton.jit
def _as_dtype(x, like_ptr, BF16: tl.constexpr):
    """float32 ``x`` rounded to the dtype of ``like_ptr``, back in float32."""
    return narrow(x, like_ptr, BF16).to(tl.float32)


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv(
    proj_ptr,
    win_ptr,
    w_ptr,
    slots_ptr,
    y_ptr,
    ld,
    conv_dim,
    nslots,
    KERNEL: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t)
    live = tl.where((slot >= 0) & (slot < nslots), conv_dim, 0)  # channels of a slot inside the state
    mask = c < live
    W: tl.constexpr = KERNEL - 1
    x = tl.load(proj_ptr + t * ld + c, mask=mask, other=0.0).to(tl.float32)
    win = win_ptr + (slot * conv_dim + c) * W
    acc = tl.load(w_ptr + c * KERNEL + W, mask=mask, other=0.0).to(tl.float32) * x
    for j in tl.static_range(W):
        tap = tl.load(w_ptr + c * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        acc += tap * tl.load(win + j, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(W):  # shift: each program owns its channels' windows
        if j + 1 < W:
            nxt = tl.load(win + j + 1, mask=mask, other=0.0)
        else:
            nxt = tl.load(proj_ptr + t * ld + c, mask=mask, other=0.0)
        tl.store(win + j, nxt, mask=mask)
    y = _as_dtype(_silu(_as_dtype(acc, y_ptr, BF16)), y_ptr, BF16)
    tl.store(y_ptr + t * conv_dim + c, narrow(y, y_ptr, BF16), mask=mask)


@triton.jit
def _rule(
    y_ptr,
    proj_ptr,
    b_ptr,
    a_ptr,
    A_ptr,
    dt_ptr,
    nw_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    ld,
    nk,
    nv,
    dk,
    dv,
    nslots,
    eps,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (nv // nk)
    conv_dim = 2 * nk * dk + nv * dv
    slot = tl.load(slots_ptr + t)
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_V)
    mi = i < dk
    mj = j < dv
    row = y_ptr + t * conv_dim
    q = tl.load(row + kh * dk + i, mask=mi, other=0.0).to(tl.float32)
    k = tl.load(row + (nk + kh) * dk + i, mask=mi, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * nk * dk + h * dv + j, mask=mj, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
    q = q / tl.sqrt(dk * 1.0)
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    bv = tl.load(b_ptr + t * nv + h).to(tl.float32)
    beta = _as_dtype(1.0 / (1.0 + tl.exp(-bv)), out_ptr, BF16)
    x = tl.load(a_ptr + t * nv + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    e = tl.exp(tl.load(A_ptr + h) * soft)
    live = tl.where((slot >= 0) & (slot < nslots), dk, 0)  # state rows of a slot inside the state
    m2 = (i < live)[:, None] & mj[None, :]
    s_ptrs = state_ptr + (slot * nv + h) * dk * dv + i[:, None] * dv + j[None, :]
    s = tl.load(s_ptrs, mask=m2, other=0.0) * e
    remembered = tl.sum(s * k[:, None], axis=0)
    delta = (v - remembered) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s, mask=m2)
    o = _as_dtype(tl.sum(s * q[:, None], axis=0), out_ptr, BF16)
    o = tl.where(mj, o, 0.0)
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / (dv * 1.0) + eps)
    hn = _as_dtype(o * r, out_ptr, BF16)
    hw = _as_dtype(tl.load(nw_ptr + j, mask=mj, other=0.0).to(tl.float32) * hn, out_ptr, BF16)
    z = tl.load(proj_ptr + t * ld + conv_dim + h * dv + j, mask=mj, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + (t * nv + h) * dv + j,
        narrow(hw * _silu(z), out_ptr, BF16),
        mask=j < tl.where(live > 0, dv, 0),
    )


def decode(
    proj: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rec_state: torch.Tensor,
    slots: torch.Tensor,
    heads: tuple[int, int, int, int],
) -> Optional[torch.Tensor]:
    """The gated output [n, v_heads * v_dim] of one decode step of n sequences, with the arguments and
    layouts of ``kernels/cpu/deltanet_step.decode`` (the windows and states advanced in place at ``slots``,
    int64, distinct, inside the state), on the tensors' device. None, with nothing touched, where the
    kernel does not take them (another dtype, a layout it does not know, a head past ``MAX_DIM``)."""
    nk, nv, dk, dv = heads
    dtype = proj.dtype
    if dtype not in (torch.float32, torch.bfloat16) or proj.dim() != 2 or nk <= 0 or nv % nk:
        return None
    n, conv_dim = proj.shape[0], 2 * nk * dk + nv * dv
    kernel = conv_weight.shape[-1]
    same = (proj, b, a, conv_state, conv_weight, dt_bias, norm_weight)
    if (
        any(t.dtype != dtype or t.device != proj.device or not t.is_contiguous() for t in same)
        or any(t.device != proj.device or not t.is_contiguous() for t in (rec_state, A, slots))
        or not (rec_state.dtype == A.dtype == torch.float32)
        or slots.dtype != torch.int64
        or proj.shape[1] != conv_dim + nv * dv
        or b.shape != (n, nv)
        or a.shape != (n, nv)
        or kernel < 1
        or conv_weight.shape != (conv_dim, kernel)
        or conv_state.shape[1:] != (conv_dim, kernel - 1)
        or rec_state.shape[1:] != (nv, dk, dv)
        or rec_state.shape[0] != conv_state.shape[0]
        or A.shape != (nv,)
        or dt_bias.shape != (nv,)
        or norm_weight.shape != (dv,)
        or slots.shape != (n,)
        or max(dk, dv) > MAX_DIM
    ):
        return None
    out = torch.empty(n, nv * dv, dtype=dtype, device=proj.device)
    if n == 0:
        return out
    bf16, nslots = dtype == torch.bfloat16, rec_state.shape[0]
    y = torch.empty(n, conv_dim, dtype=dtype, device=proj.device)
    _conv[(n, triton.cdiv(conv_dim, CONV_BLOCK))](
        proj, conv_state, conv_weight, slots, y, proj.shape[1], conv_dim, nslots,
        KERNEL=kernel, BLOCK=CONV_BLOCK, BF16=bf16, enable_fp_fusion=False,
    )  # fmt: skip
    block_k, block_v = (max(16, triton.next_power_of_2(d)) for d in (dk, dv))
    _rule[(n, nv)](
        y, proj, b, a, A, dt_bias, norm_weight, rec_state, slots, out,
        proj.shape[1], nk, nv, dk, dv, nslots, float(eps),
        BLOCK_K=block_k, BLOCK_V=block_v, BF16=bf16, num_warps=8 if block_k * block_v >= 8192 else 4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
