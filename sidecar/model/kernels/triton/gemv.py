"""A decoder layer's four products for one row in Triton, each with the elementwise step before it fused in.

A decode step at batch 1 is latency-bound on a GPU: per layer, eleven small kernels (two residual adds + norms,
four products through cuBLAS, silu * up, rope + KV write, attention) each pay a launch and a ramp while the
weights stream for a fraction of the time. For a single row (``MAX_ROWS``) these take a layer's products as
four kernels, each reading its weight once:

- ``norm_matmul(h, delta, norm_weight, eps, weight, bias)`` -> ``(y, s)``: ``s = h + delta`` (``h`` without a
  delta), ``y = (norm_weight * rms_norm(s)) @ weight.T + bias`` -- the norm before the qkv and gate/up products.
- ``silu_matmul(gu, weight, bias)`` -> ``silu(gate) * up @ weight.T + bias`` over ``gu`` [1, 2I] -- the down
  product.
- ``matmul(x, weight, bias)`` -> ``x @ weight.T + bias`` -- the o product.

Each program owns ``BLOCK_N`` outputs and walks K once, its next weight tile asked for before it works on the
current one, so there is no second kernel; every program recomputes the row's prologue (the norm's sum of
squares, the activation) from the inputs, which are small and in L2. The elementwise steps round where
``triton_ops``' kernels (and torch's unfused ops) round -- the norm in float32, cast to the model dtype before
and after its weight; silu, then the product with up, each rounded -- and the products accumulate in float32
and round once, with the bias added before, as cuBLAS does. So the results differ from the unfused path only
by the order of float32 sums. Compiled without fused multiply-adds, as ``triton_ops`` is.
From two rows on the broadcast products lose to cuBLAS (an H100, four rows: the gate/up product 28 against 8.6
us), so larger batches keep the separate kernels.
Every wrapper returns None for inputs it does not take (more rows, another dtype, a non-contiguous tensor);
``takes`` says beforehand. Imports Triton: import only where ``gpu_paths.triton_available()``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import narrow, sm_count

MAX_ROWS = 1  # measured on an H100: from two rows on, cuBLAS and the separate kernels are faster
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def config(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for an [n, k] weight: K in steps of up to 1,024; 8, 4 or 2 outputs a program,
    the most that still give two programs a multiprocessor (one for a long K, whose programs stream more); 8
    warps for a long K. Measured on an H100 over a 0.5B model's layers (qkv 4 outputs, o 2, gate/up 8, down 4)."""
    block_k = min(triton.next_power_of_2(k), 1024)
    long_k = k > 2 * block_k
    want = sms if long_k else 2 * sms
    block_n = 8
    while block_n > 2 and triton.cdiv(n, block_n) < want:
        block_n //= 2
    return block_n, block_k, 8 if long_k else 4


@triton.jit
def _summed(h_ptr, d_ptr, kk, ok, HAS_DELTA: tl.constexpr, BF16: tl.constexpr):
    """``h`` (+ ``delta``, rounded to the model dtype as the residual add rounds) at columns ``kk``."""
    x = tl.load(h_ptr + kk, mask=ok, other=0.0)
    if HAS_DELTA:
        x = narrow(x.to(tl.float32) + tl.load(d_ptr + kk, mask=ok, other=0.0).to(tl.float32), h_ptr, BF16)
    return x


@triton.jit
def _gemv(
    x_ptr,
    d_ptr,
    nw_ptr,
    s_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    n,
    k,
    eps,
    PRO: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_STEP: tl.constexpr,
    BF16: tl.constexpr,
):
    """``y[tile] = a @ w[tile].T (+ b)`` for one row ``a``, by ``PRO``: 0 ``x``; 1 ``nw * rms_norm(x + d)``
    (program 0 writes ``x + d`` to ``s``); 2 ``silu(x[:k]) * x[k:]``. ``ONE_STEP``: K fits one step."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < n
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * k
    # The weight is what takes the time: each tile is asked for one step ahead of its use, the first before
    # the prologue, so the loads are in flight while the norm's sum and the activations are computed.
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < k)[None, :], other=0.0)
    if PRO == 1:  # the row's sum of squares, before the products need the normalized values
        if ONE_STEP:  # the row is read once
            v_all = _summed(x_ptr, d_ptr, rk, rk < k, HAS_DELTA, BF16)
            r = tl.rsqrt(tl.sum(v_all.to(tl.float32) * v_all.to(tl.float32), 0) / k + eps)
        else:
            sq = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, k, BLOCK_K):
                kk = k0 + rk
                v = _summed(x_ptr, d_ptr, kk, kk < k, HAS_DELTA, BF16).to(tl.float32)
                sq += v * v
            r = tl.rsqrt(tl.sum(sq, 0) / k + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k
        if not ONE_STEP:
            nxt = kk + BLOCK_K
            w_next = tl.load(w_rows + nxt[None, :], mask=n_ok[:, None] & (nxt < k)[None, :], other=0.0)
        if PRO == 1:
            if ONE_STEP:
                v = v_all
            else:
                v = _summed(x_ptr, d_ptr, kk, k_ok, HAS_DELTA, BF16)
            if HAS_DELTA:
                if pid == 0:
                    tl.store(s_ptr + kk, v, mask=k_ok)
            nv = narrow(v.to(tl.float32) * r, x_ptr, BF16)
            g = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = narrow(g * nv.to(tl.float32), x_ptr, BF16)
        elif PRO == 2:
            gate = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + k + kk, mask=k_ok, other=0.0)
            act = narrow(gate / (1.0 + tl.exp(-gate)), x_ptr, BF16)
            a = narrow(act.to(tl.float32) * up.to(tl.float32), x_ptr, BF16)
        else:
            a = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        acc += a.to(tl.float32)[None, :] * w.to(tl.float32)
        if not ONE_STEP:
            w = w_next
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, narrow(y, y_ptr, BF16), mask=n_ok)


def takes(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, k: Optional[int] = None
) -> bool:
    """Whether the kernels take rows ``x`` [M, K'] against ``weight`` [N, K] (K = ``k``, default K')."""
    k = x.shape[-1] if k is None else k
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in _DTYPES
        and x.is_contiguous()
        and weight.dim() == 2
        and weight.shape[1] == k
        and k > 0
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.device == x.device
        and (
            bias is None
            or (bias.shape == (weight.shape[0],) and bias.dtype == x.dtype and bias.is_contiguous())
        )
    )


def _launch(x, d, nw, s, weight, bias, k, eps, pro) -> torch.Tensor:
    n = weight.shape[0]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config(n, k, sm_count(x.device))
    _gemv[(triton.cdiv(n, block_n),)](
        x,
        x if d is None else d,
        x if nw is None else nw,
        x if s is None else s,
        weight,
        weight if bias is None else bias,
        y,
        n,
        k,
        float(eps),
        PRO=pro,
        HAS_DELTA=d is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_STEP=k <= block_k,
        BF16=x.dtype == torch.bfloat16,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return y


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    if not takes(x, weight, bias):
        return None
    return _launch(x, None, None, None, weight, bias, x.shape[1], 0.0, 0)


def norm_matmul(
    h: torch.Tensor,
    delta: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if (
        not takes(h, weight, bias)
        or norm_weight.shape != (h.shape[1],)
        or norm_weight.dtype != h.dtype
        or not norm_weight.is_contiguous()
        or (
            delta is not None
            and (delta.shape != h.shape or delta.dtype != h.dtype or not delta.is_contiguous())
        )
    ):
        return None
    s = h if delta is None else torch.empty_like(h)
    return _launch(h, delta, norm_weight, s, weight, bias, h.shape[1], eps, 1), s


def silu_matmul(
    gu: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    if gu.dim() != 2 or gu.shape[1] % 2 or not takes(gu, weight, bias, gu.shape[1] // 2):
        return None
    return _launch(gu, None, None, None, weight, bias, gu.shape[1] // 2, 0.0, 2)
