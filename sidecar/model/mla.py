"""Multi-head latent attention (DeepSeek V3, Mistral 4) over a paged cache of latents.

Per token and layer the cache holds what every head's keys and values are expanded from: the normed latent
(``kv_lora_rank`` values) and the rotated key part shared by the heads (``rope_dim``), so a token costs
``kv_lora_rank + rope_dim`` elements per layer instead of ``2 * heads * head_dim``. Layout: the pair
``(latent [num_blocks, block_size, 1, kv_lora_rank], rope [num_blocks, block_size, 1, rope_dim])``, block-
indexed as the per-head K/V caches are, so block copies, zeroing, offload and prefix caching move it
unchanged (kv_quant's block helpers act on any tuple of block-indexed tensors).

Prompt rows expand the latents of their context to per-head keys ``[k_nope | k_rope]`` and values (``kv_b``)
and attend as HF does. Decode rows attend on the latents themselves (absorbed projections): the query's
no-rope part is folded through ``W_UK`` into latent space, scores are ``q_lat . c + q_rope . k_rope``, the
probabilities weigh the latents, and ``W_UV`` maps the weighted latent to each head's value: the same
attention with the products reassociated, reading ``kv_lora_rank + rope_dim`` values a cached token
instead of expanding every head's keys and values.

The paged-attention kernels (CPU, Triton) read per-head K/V and do not take the latent cache; the model's
start-up log says so. On CPU the decode rows' attention on the latents runs in
``kernels/cpu/latent_attention`` where it takes the inputs and is the faster path (bf16; float32 up to
``F32_MAX_HEADS`` heads; the reason is logged once where it is not); on CUDA in
``kernels/triton/latent_attention`` where it passed its self-check there (``triton_ready``, once, a failure
logged; not a FastPaths field) and no scored eviction asks for the weights' sums. ``torch_decode`` stays
their oracle.
``kv_b`` is a plain parameter (not a ``Linear``), so the CPU weight packing leaves it readable by the
absorbed decode.

HF rotates DeepSeek's rotary channels in interleaved pairs and writes the result de-interleaved (evens,
then odds); the same values come from gathering the channels evens-first and rotating rotate-half style,
which is what ``rotate`` does.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model import attention_scores, kv_quant
from sidecar.model.attention import AttentionMetadata
from sidecar.model.kernels.cpu import latent_attention as cpu_latent
from sidecar.model.kernels.gpu_paths import FastPaths, triton_interpreted, triton_kernel_ready
from sidecar.model.layers import RMSNorm, rotate
from sidecar.model.linear import Linear

log = logging.getLogger("sidecar.model")

FAST_PATH_REASON = (
    "the paged-attention kernels read per-head K/V, not latents (decode rows take the latent kernels: C on "
    "CPU, Triton on CUDA)"
)
# HF's q_a_layernorm and kv_a_layernorm keep their default epsilon whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6
_refusals_logged: set[str] = set()
_triton_checked: dict[str, str] = {}  # device type -> why the Triton decode kernel is off ('' when on)
_triton_on_cpu = [False]  # use_triton_on_cpu


def _kernel_decode(q_lat, q_rope, kv, meta: AttentionMetadata, scale: float) -> Optional[torch.Tensor]:
    """The decode rows' probability-weighted latents [B, heads, r] from the CPU kernel, or None (the reason
    logged once) where it does not take the inputs or torch's path is the faster one for them."""
    why = cpu_latent.refusal(q_lat, kv[0], kv[1])
    why = why or cpu_latent.slower_than_torch(q_lat.dtype, q_lat.shape[1])
    if why is not None:
        if why not in _refusals_logged:
            _refusals_logged.add(why)
            log.info("latent attention decode on the torch path: %s", why)
        return None
    return cpu_latent.decode_attention(
        q_lat, q_rope, kv[0], kv[1], meta.decode_block_tables, meta.decode_ctx_lens, scale, meta.kv_scores
    )


def _triton_decode(q_lat, q_rope, kv, meta: AttentionMetadata, scale: float) -> Optional[torch.Tensor]:
    """The decode rows' weighted latents from the Triton kernel where it passed its self-check on this device;
    None where it is off, where scored eviction wants the torch path's sums, or it does not take the inputs."""
    if meta.kv_scores is not None or not triton_ready(q_lat.device):
        return None
    return triton_latent().decode_attention(
        q_lat, q_rope, kv[0], kv[1], meta.decode_block_tables, meta.decode_ctx_lens, scale
    )


def triton_check(decode, device: str = "cpu", parts: Optional[int] = None) -> str:
    """'' when the Triton decode ``decode`` on ``device`` agrees with ``torch_decode`` on CPU over both dtypes,
    head counts under and past a head group, contexts across block edges and (``parts`` of them, None: the
    kernel's choice) context partitions, scattered blocks; else why not."""
    gen = torch.Generator().manual_seed(0)
    bs, nblocks, ctx = 4, 24, torch.tensor([1, 5, 9, 60])
    tables = torch.stack([torch.randperm(nblocks, generator=gen)[:16] for _ in range(4)])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=bs,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
    )
    kw = {} if parts is None else {"parts": parts}
    for dtype, heads, tol in ((torch.float32, 3, 1e-5), (torch.bfloat16, 18, 3e-2)):
        kv = tuple(torch.randn(nblocks, bs, 1, w, generator=gen).to(dtype) for w in (40, 8))
        q_lat, q_rope = ((torch.randn(4, heads, w, generator=gen) * 0.3).to(dtype) for w in (40, 8))
        want = torch_decode(q_lat, q_rope, kv, meta, 0.2)
        on = (x.to(device) for x in (q_lat, q_rope, *kv, tables, ctx))
        got = decode(*on, 0.2, **kw)
        if got is None:
            return f"the kernel refused {dtype} rows"
        err, bound = (
            float((got.cpu().float() - want.float()).abs().max()),
            tol * (1 + float(want.abs().max())),
        )
        if not err <= bound:
            return f"{dtype} weighted latents off from the torch form by {err:.3g} (bound {bound:.3g})"
    return ""


def use_triton_on_cpu(on: bool) -> None:
    """Run decode rows on CPU through the Triton kernel when Triton is interpreted (tests without a GPU)."""
    _triton_on_cpu[0] = on


def triton_ready(device: torch.device) -> bool:
    """The Triton latent decode kernel is installed and passed its self-check on ``device``'s type (once, before
    any graph capture; a failure is logged, and decode rows then take the torch form)."""
    return triton_kernel_ready(
        _triton_checked,
        device.type,
        device,
        lambda: triton_check(triton_latent().decode_attention, str(device)),
        "latent attention Triton decode kernel off, decode rows on torch",
    )


def triton_latent():
    from sidecar.model.kernels.triton import latent_attention  # imports Triton: only when asked

    return latent_attention


def layer_cache(
    args: ModelArgs,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    shape: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, ...]:
    """One attention layer's cache (uninitialised): an MLA layer's (latent, rotary key part), see the module's
    layout; any other layer's per-head K/V (``kv_quant.allocate``) of ``shape`` (KV heads, head size; None:
    the model's)."""
    spec = args.latent
    if spec is None:
        nkv, hd = shape or (args.num_kv_heads, args.head_dim)
        return kv_quant.allocate(num_blocks, block_size, nkv, hd, dtype, device)
    return tuple(
        torch.empty(num_blocks, block_size, 1, width, dtype=dtype, device=device)
        for width in (spec.kv_lora_rank, spec.rope_dim)
    )


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Cache bytes of one block over all layers: the latent and the rotary key part of each token."""
    return args.num_layers * block_size * args.latent.cache_width * dtype.itemsize


def check_kv_dtype(args: ModelArgs, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    """The latent cache holds values of the model dtype only (no quantized form)."""
    if args.latent is not None and kv_dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype: {args.architecture} caches multi-head latent attention latents, which have no "
            "quantized form; use kv_cache_dtype auto"
        )


def _cache_positions(meta: AttentionMetadata) -> torch.Tensor:
    """[T] each new token's cache index (its position where no block was evicted): for callers of
    ``CausalLM.forward_embedded`` that set no ``meta.positions``."""
    parts = [
        torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=meta.slot_mapping.device)
        for seg in meta.prefills
    ]
    if meta.decode_ctx_lens is not None:
        parts.append(meta.decode_ctx_lens - 1)
    return torch.cat(parts)


class LatentAttention(nn.Module):
    latent = True  # the decoder layer's marker: no fused one-row form

    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        s = args.latent
        self.spec = s
        self.nh = args.num_heads
        self.qk_dim = s.nope_dim + s.rope_dim
        h, bias = args.hidden_size, args.attention_bias
        if s.q_lora_rank is None:
            self.q_proj = Linear(h, self.nh * self.qk_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, s.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS, paths)
            self.q_b_proj = Linear(s.q_lora_rank, self.nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, s.kv_lora_rank + s.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS, paths)
        # [heads * (nope_dim + v_dim), kv_lora_rank]: each head's W_UK rows, then its W_UV rows
        self.kv_b = nn.Parameter(
            torch.empty(self.nh * (s.nope_dim + s.v_dim), s.kv_lora_rank), requires_grad=False
        )
        self.o_proj = Linear(self.nh * s.v_dim, h, bias=bias)
        self.scale = args.attn_scale
        half = s.rope_dim // 2
        # channel order that makes interleaved pairs rotate-half pairs (evens, then odds)
        self.rope_order = (
            [2 * i for i in range(half)] + [2 * i + 1 for i in range(half)] if s.interleave else None
        )

    def _query_scale(self, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """[T, 1, 1]: Mistral 4's per-position query scale, None where the family has none."""
        s = self.spec
        if s.query_scale_beta is None:
            return None
        pos = (meta.positions if meta.positions is not None else _cache_positions(meta)).float()
        scale = 1 + s.query_scale_beta * torch.log(1 + torch.floor(pos / s.query_scale_from))
        return scale[:, None, None]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``kv``: this layer's (latent, rope) cache; ``cos``, ``sin``: rope rows [kinds, T, 1, rope_dim]."""
        s, t = self.spec, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q = q.view(t, self.nh, self.qk_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, : s.kv_lora_rank].contiguous())[0]
        q_rope, k_rope = q[..., s.nope_dim :], ckv[:, None, s.kv_lora_rank :]
        if self.rope_order is not None:
            q_rope, k_rope = q_rope[..., self.rope_order], k_rope[..., self.rope_order]
        q_rope, k_rope = rotate(q_rope, cos[0], sin[0]), rotate(k_rope, cos[0], sin[0])
        q = torch.cat((q[..., : s.nope_dim], q_rope), dim=-1)
        qs = self._query_scale(meta)
        if qs is not None:
            q = q * qs.to(q.dtype)
        kv[0].view(-1, s.kv_lora_rank).index_copy_(0, meta.slot_mapping, latent)
        kv[1].view(-1, s.rope_dim).index_copy_(0, meta.slot_mapping, k_rope[:, 0])
        out = q.new_empty(t, self.nh, s.v_dim)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill(q[rows], kv, seg, meta.kv_scores)
        if meta.decode_block_tables is not None:
            b = meta.decode_block_tables.shape[0]
            out[t - b :] = self._decode(q[t - b :], kv, meta)
        return self.o_proj(out.reshape(t, self.nh * s.v_dim))

    def _prefill(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, ...], seg, scores: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """One prompt segment: its context's latents expanded to per-head keys and values, causal SDPA (with
        ``scores``: explicit weights, each key's added to its slot, attention_scores.py)."""
        s, n = self.spec, seg.ctx_len
        latent = kv[0].index_select(0, seg.block_table).view(-1, s.kv_lora_rank)[:n]
        k_rope = kv[1].index_select(0, seg.block_table).view(-1, 1, s.rope_dim)[:n]
        kvb = F.linear(latent, self.kv_b).view(n, self.nh, s.nope_dim + s.v_dim)
        k = torch.cat((kvb[..., : s.nope_dim], k_rope.expand(n, self.nh, s.rope_dim)), dim=-1)
        v = kvb[..., s.nope_dim :]
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
        start = n - seg.q_len
        if scores is not None:
            qpos = torch.arange(start, n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= qpos
            o, w = attention_scores.weighted(qh, kh, vh, mask, self.scale, None)
            slots = attention_scores.table_slots(seg.block_table[None], kv[0].shape[1], n)[0]
            attention_scores.add_scores(scores, slots, w[0])
        elif start == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            qpos = torch.arange(start, n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows [B, heads, qk_dim] on the latents (absorbed projections): [B, heads, v_dim]."""
        s = self.spec
        w = self.kv_b.view(self.nh, s.nope_dim + s.v_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.nope_dim], w[:, s.nope_dim :]
        # [B, H, nope] x [H, nope, r] -> [B, H, r]: each head's query in latent space
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., : s.nope_dim], w_uk)
        o_lat = None
        if q.is_cuda or (q.device.type == "cpu" and _triton_on_cpu[0] and triton_interpreted()):
            o_lat = _triton_decode(q_lat, q[..., s.nope_dim :], kv, meta, self.scale)
        elif meta.use_cpu_kernel:
            o_lat = _kernel_decode(q_lat, q[..., s.nope_dim :], kv, meta, self.scale)
        if o_lat is None:
            o_lat = self._decode_torch(q_lat, q[..., s.nope_dim :], kv, meta)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)

    def _decode_torch(
        self, q_lat: torch.Tensor, q_rope: torch.Tensor, kv: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:
        return torch_decode(q_lat, q_rope, kv, meta, self.scale)


def torch_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The kernels' oracle: each decode row's latents gathered, [B, heads, r] weighted latents."""
    bt = meta.decode_block_tables
    b, nb = bt.shape
    bs, rank, rope = kv[0].shape[1], kv[0].shape[-1], kv[1].shape[-1]
    latent = kv[0].index_select(0, bt.reshape(-1)).view(b, nb * bs, rank)
    k_rope = kv[1].index_select(0, bt.reshape(-1)).view(b, nb * bs, rope)
    scores = torch.matmul(q_lat, latent.transpose(1, 2)) + torch.matmul(q_rope, k_rope.transpose(1, 2))
    scores = (scores * scale).masked_fill(~meta.decode_mask(None)[:, 0], -math.inf)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if meta.kv_scores is not None:  # scored eviction: each key's weight, summed over heads
        slots = attention_scores.table_slots(bt, bs, nb * bs)
        attention_scores.add_scores(meta.kv_scores, slots, torch.nan_to_num(probs).sum(dim=1))
    return torch.matmul(probs.to(q_lat.dtype), latent)  # [B, H, r]


def load(attn: LatentAttention, get: Callable, prefix: str, put: Callable) -> None:
    """The MLA projections and norms of the layer at ``prefix`` (``put(module, name, tensor)`` sets one,
    in the model dtype)."""
    p = f"{prefix}.self_attn"
    linears = ["kv_a_proj_with_mqa", "o_proj"]
    linears += ["q_proj"] if attn.q_proj is not None else ["q_a_proj", "q_b_proj"]
    for name in linears:
        lin = getattr(attn, name)
        put(lin, "weight", get(f"{p}.{name}.weight"))
        if lin.bias is not None:
            put(lin, "bias", get(f"{p}.{name}.bias"))
    norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if attn.q_a_layernorm is not None else [])
    for name in norms:
        put(getattr(attn, name), "weight", get(f"{p}.{name}.weight"))
    put(attn, "kv_b", get(f"{p}.kv_b_proj.weight"))
