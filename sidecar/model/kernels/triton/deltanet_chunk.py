"""The gated delta rule over a prompt chunk in Triton (the GPU form of ``deltanet_rule.chunked_rule``, and of
``sidecar_deltanet_rule`` in kernels/cpu/deltanet_step.c): one sequence's L tokens from its slot's float32
state [v_heads, k_dim, v_dim], advanced in place.

One program per (value head, block of ``BLOCK_V`` state columns): the columns of ``S`` are independent (every
product below reads ``S`` column by column), so a program holds its [k_dim, BLOCK_V] tile in registers for
the whole sequence and walks the tokens in blocks of ``CHUNK``. Per block, with ``c`` the cumulative log
decay from the block's start, ``kb = beta k``, ``P[i, j] = exp(c_i - c_j)`` for ``i >= j`` (0 above)::

    A     = strictly lower part of (kb k^T) * P          T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...
    new_v = T (beta v);   w = T (kb exp(c))              u = new_v - w S
    o     = (q exp(c)) S + ((q k^T) * P) u
    S     = S exp(c_last) + (k exp(c_last - c))^T u

which is HF's chunked form (the triangular solve done as T's product instead), so the result equals the torch
form within float32 rounding; the block size only changes the order of float32 sums. ``A`` is nilpotent
(A^CHUNK = 0), so ``(I + A)(I - A)(I + A^2)...(I + A^(CHUNK/2)) = I - A^CHUNK = I``: log2(CHUNK)
squarings and products of [CHUNK, CHUNK] tiles instead of CHUNK dependent row steps of a substitution.
Tokens past L load as zeros (k = v = beta = g = 0) and so add nothing, as the torch form's padding does.

Every matrix product runs at full float32 precision (``input_precision="ieee"``: no TF32), as the state is
float32 whatever the model dtype. Inputs: ``q``, ``k`` [L, k_heads, k_dim] L2-normed (q scaled by
k_dim ** -0.5), ``v`` [L, v_heads, v_dim], ``g`` (log decay), ``beta`` [L, v_heads], all float32, rows at any
stride with each row's heads packed; value head h reads key head h // (v_heads // k_heads).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import mma

MAX_DIM = 256  # bound on k_dim: a program holds [CHUNK, k_dim] q and k tiles and a [k_dim, BLOCK_V] state
CHUNK = 32  # tokens per block; dots need at least 16 on every side
BLOCK_V = 32  # state columns per program


@triton.jit
def _chunk_rule(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    L,
    s_q,
    s_k,
    s_v,
    s_g,
    s_b,
    nk,
    nv,
    dk,
    dv,
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    h = tl.program_id(0)
    kh = h // (nv // nk)
    t = tl.arange(0, CHUNK)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mi = i < dk
    mj = j < dv
    s_ptrs = state_ptr + h * dk * dv + i[:, None] * dv + j[None, :]
    s = tl.load(s_ptrs, mask=mi[:, None] & mj[None, :], other=0.0)
    causal = t[:, None] >= t[None, :]
    lower = t[:, None] > t[None, :]
    eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for start in range(0, L, CHUNK):
        rows = start + t
        mt = rows < L
        mk = mt[:, None] & mi[None, :]
        mv = mt[:, None] & mj[None, :]
        q = tl.load(q_ptr + rows[:, None] * s_q + kh * dk + i[None, :], mask=mk, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * s_k + kh * dk + i[None, :], mask=mk, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * s_v + h * dv + j[None, :], mask=mv, other=0.0)
        g = tl.load(g_ptr + rows * s_g + h, mask=mt, other=0.0)
        beta = tl.load(beta_ptr + rows * s_b + h, mask=mt, other=0.0)
        c = tl.cumsum(g, axis=0)  # log decay from the block's start to each token (padding: the last one's)
        c_last = tl.sum(tl.where(t == CHUNK - 1, c, 0.0), axis=0)
        pair = tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))  # decay j -> i, 0 above
        kb = k * beta[:, None]
        kt = tl.trans(k)
        a = tl.where(lower, mma(kb, kt, True) * pair, 0.0)
        # T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: the factors are polynomials in A, so they commute
        tri = eye - a
        power = a
        for _ in tl.static_range(LOG2_CHUNK - 1):
            power = mma(power, power, True)
            tri = tri + mma(tri, power, True)
        e = tl.exp(c)
        new_v = mma(tri, v * beta[:, None], True)
        w = mma(tri, kb * e[:, None], True)
        u = new_v - mma(w, s, True)
        intra = mma(q, kt, True) * pair
        o = mma(q * e[:, None], s, True) + mma(intra, u, True)
        tl.store(out_ptr + (rows[:, None] * nv + h) * dv + j[None, :], o, mask=mv)
        k_end = k * tl.exp(c_last - c)[:, None]
        s = s * tl.exp(c_last) + mma(tl.trans(k_end), u, True)
    tl.store(s_ptrs, s, mask=mi[:, None] & mj[None, :])


def _rows_packed(x: torch.Tensor) -> bool:
    """Rows at any stride, each row's heads and their elements contiguous."""
    return x.dim() < 2 or (x.stride(-1) == 1 and (x.dim() == 2 or x.stride(-2) == x.shape[-1]))


def rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
    block_v: int = BLOCK_V,
) -> Optional[torch.Tensor]:
    """The rule's output [L, v_heads, v_dim] float32 over one sequence's L tokens (the arguments of
    ``kernels/cpu/deltanet_step.rule``; layouts in the module docstring), ``state`` [v_heads, k_dim, v_dim]
    float32 contiguous, advanced in place, on the tensors' device. ``chunk`` and ``block_v`` (powers of two,
    at least 16) size the token blocks and column tiles. None, with nothing touched, where the kernel does
    not take them."""
    if q.dim() != 3 or v.dim() != 3 or g.dim() != 2 or beta.dim() != 2:
        return None
    (length, nk, dk), nv, dv = q.shape, v.shape[1], v.shape[2]
    every = (q, k, v, g, beta, state)
    if (
        any(t.dtype != torch.float32 or t.device != q.device or not _rows_packed(t) for t in every)
        or not state.is_contiguous()
        or k.shape != q.shape
        or v.shape[0] != length
        or g.shape != (length, nv)
        or beta.shape != (length, nv)
        or state.shape != (nv, dk, dv)
        or min(dk, dv, nk) < 1
        or dk > MAX_DIM
        or nv % nk
        or chunk < 16
        or block_v < 16
        or chunk & (chunk - 1)
        or block_v & (block_v - 1)
    ):
        return None
    out = torch.empty(length, nv, dv, dtype=torch.float32, device=q.device)
    if length == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _chunk_rule[(nv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, out, length,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), nk, nv, dk, dv,
        CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, BLOCK_K=block_k, BLOCK_V=block_v,
        num_warps=8 if block_k * block_v >= 4096 else 4,
    )  # fmt: skip
    return out
