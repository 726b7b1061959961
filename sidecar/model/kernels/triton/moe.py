"""A mixture-of-experts block's experts in two Triton launches over the step's rows sorted by expert.

``layout(ids, num_experts, block_m)`` sorts the step's T * k (token, slot) pairs by expert into a
block-aligned layout: each expert's rows padded up to a multiple of ``block_m``, so every tile of ``block_m``
rows belongs to one expert. It returns ``rows`` [tiles * block_m] (the slot index token * k + j of each
position, -1 for padding) and ``tile_expert`` [tiles] (each tile's expert, -1 past the last used tile).
``tiles`` is an upper bound from the shapes alone, ``(T * k + min(E, T * k) * (block_m - 1)) / block_m``:
no value is read back to the host, so the whole step can be captured in a CUDA graph (torch's sort,
cumulative sums and searchsorted).

``grouped_moe(x, weights, ids, experts, act)`` then runs every expert at once:
- launch 1, per (tile, column block): ``gate`` and ``up`` of the tile's rows against the expert's stacked
  gate/up weight [E, 2I, H] (gate rows first), bias added, each rounded to the model dtype as a ``Linear``
  output rounds, then the activation: ``silu(gate) * up``, ``gelu_tanh(gate) * up`` (GeGLU) or gpt-oss's
  clamped SwiGLU ``(clamp(up) + 1) * (g * sigmoid(g * alpha))``, ``g = min(gate, limit)``, rounding after
  each op as torch's unfused ops round; written at the tile's positions [tiles * block_m, I];
- launch 2: the activations against the stacked down weight [E, H, I] plus bias, rounded to the model dtype,
  times the slot's routing weight (in the dtype ``x`` and the weights promote to) and scattered to the
  slot's row of [T * k, H]; the k slots of a token are summed by torch, in slot order, as the eager path sums
  them. With ``scale_input`` (Llama 4) the routing weight scales the expert's input instead.
Products accumulate in float32 (``common.mma``). Experts no row picked cost one early exit per tile slot.

MXFP4 experts (gpt-oss checkpoints; ``Experts`` with ``gate_up_scales`` / ``down_scales``) are read as their
codes: ``gate_up`` / ``down`` are then uint8 [E, rows, cols / 2] (two 4-bit E2M1 codes a byte, the even column
in the low nibble) and the scales uint8 [E, rows, cols / 32] (E8M0, bias 127). Each weight tile is decoded in
registers to the model dtype before its product: an E2M1 value times a power of two is exact in every float
dtype whose range holds it, so the result is the plain kernel's on the dequantized weights.
Returns None for inputs it does not take; the caller runs the torch path. Imports Triton.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import dot_in_f32, mma, narrow, tanh32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SILU, GELU_TANH, CLAMPED_SWIGLU = 0, 1, 2


class Experts(NamedTuple):
    """Stacked expert weights: gate/up [E, 2I, H] (gate rows first), its bias [E, 2I] or None, down [E, H, I],
    its bias [E, H] or None; all in the model dtype, contiguous. With ``gate_up_scales`` and ``down_scales``
    (uint8 [E, 2I, H / 32] and [E, H, I / 32]) the two weights are MXFP4 codes, uint8 [E, 2I, H / 2] and
    [E, H, I / 2] (module text); the biases stay in the model dtype."""

    gate_up: torch.Tensor
    gate_up_bias: Optional[torch.Tensor]
    down: torch.Tensor
    down_bias: Optional[torch.Tensor]
    gate_up_scales: Optional[torch.Tensor] = None
    down_scales: Optional[torch.Tensor] = None

    @property
    def mxfp4(self) -> bool:
        return self.gate_up_scales is not None

    def sizes(self) -> tuple[int, int, int]:
        """(E, I, H): experts, intermediate and hidden widths."""
        e, two_i, cols = self.gate_up.shape
        return e, two_i // 2, cols * 2 if self.mxfp4 else cols


def block_m_for(rows: int, num_experts: int) -> int:
    """Tile height from the shapes: 16 rows (``tl.dot``'s least) for decode-sized steps, up to 64 when the
    experts average that many rows."""
    per = rows // max(num_experts, 1)
    return 64 if per >= 64 else 32 if per >= 32 else 16


def layout(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [tiles * block_m] int32, tile_expert [tiles] int32) for expert ids [T, k] (module text)."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    tiles = (n + min(num_experts, n) * (block_m - 1)) // block_m
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).index_add_(0, flat, torch.ones_like(flat))
    used = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(used, 0)
    te = torch.searchsorted(tile_end, torch.arange(tiles, device=dev), right=True)
    tile_expert = torch.where(te < num_experts, te, -1).to(torch.int32)
    padded_start = (tile_end - used) * block_m
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat.index_select(0, order)
    pos = (
        padded_start.index_select(0, sorted_e) + torch.arange(n, device=dev) - start.index_select(0, sorted_e)
    )
    rows = torch.full((tiles * block_m,), -1, dtype=torch.int32, device=dev)
    rows.index_copy_(0, pos, order.to(torch.int32))
    return rows, tile_expert


@triton.jit
def _activate(g, u, limit, alpha, ACT: tl.constexpr, like_ptr, BF16: tl.constexpr):
    """The activation of rounded gate and up values (float32), rounded as torch's unfused ops round."""
    if ACT == 0:
        a = narrow(g / (1.0 + tl.exp(-g)), like_ptr, BF16).to(tl.float32)
        return narrow(a * u, like_ptr, BF16)
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = narrow(0.5 * g * (1.0 + tanh32(inner)), like_ptr, BF16).to(tl.float32)
        return narrow(a * u, like_ptr, BF16)
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        ga = narrow(g * alpha, like_ptr, BF16).to(tl.float32)
        s = narrow(1.0 / (1.0 + tl.exp(-ga)), like_ptr, BF16).to(tl.float32)
        gs = narrow(g * s, like_ptr, BF16).to(tl.float32)
        u1 = narrow(u + 1.0, like_ptr, BF16).to(tl.float32)
        return narrow(u1 * gs, like_ptr, BF16)


@triton.jit
def _w_tile(w_e, s_e, rn, kk, cols, mask, MX: tl.constexpr, like_ptr):
    """The weight tile [BLOCK_K, BLOCK_N] (input columns ``kk``, output rows ``rn``) of one expert's weight
    of ``cols`` input columns at ``w_e`` (scales at ``s_e`` when ``MX``), in ``like_ptr``'s dtype; 0 where
    ``mask`` is off."""
    rows = rn[None, :].to(tl.int64)
    if MX:
        byte = tl.load(w_e + rows * (cols // 2) + kk[:, None] // 2, mask=mask, other=0).to(tl.int32)
        code = tl.where(kk[:, None] % 2 == 0, byte & 15, byte >> 4)
        exp = (code & 7) >> 1
        half = (code & 1).to(tl.float32) * 0.5
        # E2M1: 0.5 m for exponent 0 (subnormal), else (1 + 0.5 m) 2^(e - 1); the sign bit on top
        pow2 = tl.where(exp == 3, 4.0, tl.where(exp == 2, 2.0, 1.0))
        mag = tl.where(exp == 0, half, (1.0 + half) * pow2)
        val = tl.where((code & 8) != 0, -mag, mag)
        sc = tl.load(s_e + rows * (cols // 32) + kk[:, None] // 32, mask=mask, other=127).to(tl.int32)
        # 2^(sc - 127) through the float32 bits; sc = 0 is the subnormal 2^-127 (bit 22 alone)
        scale = tl.where(sc == 0, 1 << 22, sc << 23).to(tl.float32, bitcast=True)
        w = (val * scale).to(like_ptr.dtype.element_ty)
    else:  # the weight's own dtype is the model's: the cast is none (one return type for both forms)
        w = tl.load(w_e + rows * cols + kk[:, None], mask=mask, other=0.0).to(like_ptr.dtype.element_ty)
    return w


@triton.jit
def _gate_up(
    x_ptr,
    rows_ptr,
    te_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    rw_ptr,
    out_ptr,
    h,
    inter,
    top_k,
    limit,
    alpha,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_IN: tl.constexpr,
    MX: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(te_ptr + tile)
    if e >= 0:
        pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(rows_ptr + pos)
        ok = slot >= 0
        tok = tl.where(ok, slot // top_k, 0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < inter
        rk = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * 2 * inter * (h // 2 if MX else h)
        s_e = s_ptr + e.to(tl.int64) * 2 * inter * (h // 32)
        if SCALE_IN:
            rw = tl.load(rw_ptr + slot, mask=ok, other=0.0).to(tl.float32)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, h, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < h
            a = tl.load(x_ptr + tok[:, None] * h + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            if SCALE_IN:
                a = narrow(a.to(tl.float32) * rw[:, None], x_ptr, BF16)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = _w_tile(w_e, s_e, rn, kk, h, w_mask, MX, x_ptr)
            wu = _w_tile(w_e, s_e, rn + inter, kk, h, w_mask, MX, x_ptr)
            acc_g += mma(a, wg, F32)
            acc_u += mma(a, wu, F32)
        if HAS_BIAS:
            b_e = b_ptr + e.to(tl.int64) * 2 * inter
            acc_g += tl.load(b_e + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + inter + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        g = narrow(acc_g, x_ptr, BF16).to(tl.float32)
        u = narrow(acc_u, x_ptr, BF16).to(tl.float32)
        y = _activate(g, u, limit, alpha, ACT, x_ptr, BF16)
        dst = out_ptr + pos.to(tl.int64)[:, None] * inter + rn[None, :]
        tl.store(dst, y, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down(
    a_ptr,
    rows_ptr,
    te_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    rw_ptr,
    out_ptr,
    h,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_OUT: tl.constexpr,
    MX: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(te_ptr + tile)
    if e >= 0:
        pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(rows_ptr + pos)
        ok = slot >= 0
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < h
        rk = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * h * (inter // 2 if MX else inter)
        s_e = s_ptr + e.to(tl.int64) * h * (inter // 32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < inter
            a_rows = a_ptr + pos.to(tl.int64)[:, None] * inter
            a = tl.load(a_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = _w_tile(w_e, s_e, rn, kk, inter, w_mask, MX, a_ptr)
            acc += mma(a, w, F32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * h + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = narrow(acc, a_ptr, BF16)  # the expert's output in the model dtype
        if SCALE_OUT:
            rw = tl.load(rw_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            y = narrow(y.to(tl.float32) * rw[:, None], out_ptr, OUT_BF16)
        dst = out_ptr + tl.where(ok, slot, 0).to(tl.int64)[:, None] * h + rn[None, :]
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


def _block(n: int, most: int) -> int:
    return max(16, min(most, triton.next_power_of_2(n)))


def takes(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> bool:
    """Whether ``grouped_moe`` takes rows ``x`` [T, H] routed by ``weights`` / ``ids`` [T, k]."""
    e, inter, h = experts.sizes()
    mx = experts.mxfp4
    w_dtype = torch.uint8 if mx else x.dtype
    down_cols = inter // 2 if mx else inter
    tensors = [t for t in experts if t is not None]
    return (
        x.dim() == 2
        and x.dtype in _DTYPES
        and x.is_contiguous()
        and x.shape[0] > 0
        and x.shape[1] == h
        and weights.shape == ids.shape
        and ids.dim() == 2
        and experts.gate_up.dtype == w_dtype
        and experts.down.dtype == w_dtype
        and experts.down.shape == (e, h, down_cols)
        and (not mx or _mx_scales_fit(experts, e, inter, h))
        and all(t.device == x.device and t.is_contiguous() for t in tensors)
        and all(t is None or t.dtype == x.dtype for t in (experts.gate_up_bias, experts.down_bias))
    )


def _mx_scales_fit(experts: Experts, e: int, inter: int, h: int) -> bool:
    gs, ds = experts.gate_up_scales, experts.down_scales
    return (
        h % 32 == 0
        and inter % 32 == 0
        and ds is not None
        and gs.dtype == ds.dtype == torch.uint8
        and gs.shape == (e, 2 * inter, h // 32)
        and ds.shape == (e, h, inter // 32)
    )


def grouped_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Experts,
    act: int = SILU,
    limit: float = 0.0,
    alpha: float = 0.0,
    scale_input: bool = False,
) -> Optional[torch.Tensor]:
    """The routed sum [T, H] in ``x``'s dtype of ``x`` [T, H] through ``experts``, each token's k slots
    (``ids`` [T, k], their routing ``weights`` [T, k]) as ``SparseMoE``'s torch path computes them."""
    if not takes(x, weights, ids, experts):
        return None
    (t, h), k = x.shape, ids.shape[1]
    num_experts, inter, _ = experts.sizes()
    mx = experts.mxfp4
    bm = block_m_for(t * k, num_experts)
    rows, tile_expert = layout(ids, num_experts, bm)
    rw = weights.reshape(-1).contiguous()
    act_buf = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    out_dtype = x.dtype if scale_input else torch.promote_types(x.dtype, weights.dtype)
    slots = torch.empty(t * k, h, dtype=out_dtype, device=x.device)
    f32, bf16 = dot_in_f32(x.dtype), x.dtype == torch.bfloat16
    tiles = tile_expert.shape[0]
    bn, bk = _block(inter, 64), _block(h, 64)
    _gate_up[(tiles, triton.cdiv(inter, bn))](
        x,
        rows,
        tile_expert,
        experts.gate_up,
        experts.gate_up_scales if mx else experts.gate_up,
        x if experts.gate_up_bias is None else experts.gate_up_bias,
        rw,
        act_buf,
        h,
        inter,
        k,
        float(limit),
        float(alpha),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        ACT=act,
        HAS_BIAS=experts.gate_up_bias is not None,
        SCALE_IN=scale_input,
        MX=mx,
        F32=f32,
        BF16=bf16,
        enable_fp_fusion=False,
    )
    bn, bk = _block(h, 64), _block(inter, 64)
    _down[(tiles, triton.cdiv(h, bn))](
        act_buf,
        rows,
        tile_expert,
        experts.down,
        experts.down_scales if mx else experts.down,
        x if experts.down_bias is None else experts.down_bias,
        rw,
        slots,
        h,
        inter,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        HAS_BIAS=experts.down_bias is not None,
        SCALE_OUT=not scale_input,
        MX=mx,
        F32=f32,
        BF16=bf16,
        OUT_BF16=out_dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )
    per = slots.view(t, k, h)
    out = per[:, 0].to(x.dtype)
    for j in range(1, k):  # a token's slots one add at a time in x's dtype, as SparseMoE.forward sums them
        out = out + per[:, j].to(x.dtype)
    return out
