"""Quantized KV cache: int8 (or fp8 e4m3) values with one float32 scale per token and KV head.

A quantized layer cache is four tensors, ``(k, v, k_scale, v_scale)``: ``k``/``v`` are
``[num_blocks, block_size, nkv, hd]`` int8 (or float8_e4m3fn) and ``k_scale``/``v_scale`` are
``[num_blocks, block_size, nkv]`` float32, indexed by the same block id and slot, so a block's values and
its scales travel together (offload copies both). An unquantized cache is the pair ``(k, v)``.

Invariant: a stored row ``x`` (hd values of one token and KV head) is ``q * s`` with
``s = max|x| / QMAX`` (1 for an all-zero row, so nothing divides by zero) and ``q = round(x / s)`` (int8,
in [-127, 127]) or ``x / s`` rounded to e4m3 (fp8). Every writer goes through ``write``, so the torch
reference, the CPU kernel and any device kernel read the same codes and scales.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger("sidecar.model")

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def resolve_kv_dtype(name: str, device: torch.device, compute_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The cache element type for ``kv_cache_dtype`` ``name`` on ``device`` and why (a fallback says so)."""
    if name == "auto":
        return compute_dtype, "the compute dtype"
    if name == "int8":
        return torch.int8, "requested"
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype: must be one of auto, int8, fp8, got {name!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return torch.float8_e4m3fn, "requested"
    reason = "fp8 needs CUDA sm89+; int8 instead"
    log.warning("kv_cache_dtype fp8 on %s: %s", device, reason)
    return torch.int8, reason


def kv_dtype_name(dtype: torch.dtype) -> str:
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}.get(dtype, str(dtype).replace("torch.", ""))


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def bytes_per_token_head(dtype: torch.dtype, head_dim: int) -> int:
    """Cache bytes for one token of one KV head of K (or V): values plus, when quantized, the scale."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return head_dim * elem + (4 if is_quantized(dtype) else 0)


def allocate(
    num_blocks: int, block_size: int, nkv: int, hd: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """One layer's cache: ``(k, v)``, or ``(k, v, k_scale, v_scale)`` for a quantized dtype (uninitialised)."""
    shape = (num_blocks, block_size, nkv, hd)
    out = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
    if is_quantized(dtype):
        out += [torch.empty(shape[:3], dtype=torch.float32, device=device) for _ in range(2)]
    return tuple(out)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> (codes [..., hd] of ``dtype``, scales [...] float32); see the module invariant."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # Divided by a tensor, not a Python number: CUDA multiplies by the reciprocal of a scalar divisor,
    # which can land one unit off the division every other writer (the CPU, the Triton kernels) rounds.
    scale = amax / amax.new_full((), QMAX[dtype])
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale[..., None]
    if dtype == torch.int8:
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., hd] with scales [...] -> values in ``dtype`` (products in float32)."""
    return (codes.float() * scale[..., None]).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes as their bytes (copies and index ops lack fp8 kernels on some devices); int8 as is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write(cache: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new tokens' K/V [T, nkv, hd] at cache slots [T] of a quantized layer cache."""
    kc, vc, ks, vs = cache
    nkv, hd = kc.shape[-2], kc.shape[-1]
    for x, codes, scales in ((k, kc, ks), (v, vc, vs)):
        q, s = quantize(x, codes.dtype)
        _bits(codes).view(-1, nkv, hd).index_copy_(0, slots, _bits(q))
        scales.view(-1, nkv).index_copy_(0, slots, s)


def gather(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_table: torch.Tensor,
    length: Optional[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The blocks of ``block_table`` (any leading shape) dequantized to ``dtype``: [..., n * bs, nkv, hd],
    cut to ``length`` tokens when given (then ``block_table`` is one row)."""
    nkv, hd = codes.shape[-2], codes.shape[-1]
    lead = block_table.shape
    c = _bits(codes).index_select(0, block_table.reshape(-1)).view(codes.dtype)
    s = scales.index_select(0, block_table.reshape(-1))
    out = dequantize(c, s, dtype).reshape(*lead[:-1], -1, nkv, hd)
    return out if length is None else out[:length]


def gather_heads(
    cache: torch.Tensor, scales: Optional[torch.Tensor], tables: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The blocks of ``tables`` [B, n] as [B, Hkv, n * block_size, D]: a quantized cache (``scales`` given)
    dequantized to ``dtype``, a plain one as stored."""
    b, n = tables.shape
    if scales is not None:
        return gather(cache, scales, tables, None, dtype).transpose(1, 2)
    nkv, hd = cache.shape[-2], cache.shape[-1]
    return cache.index_select(0, tables.reshape(-1)).view(b, n * cache.shape[1], nkv, hd).transpose(1, 2)


def zero_blocks(caches: list[tuple[torch.Tensor, ...]], lo: int, hi: int) -> None:
    """Blocks lo..hi (inclusive) of every layer's tensors set to zero (codes and scales)."""
    for layer in caches:
        for t in layer:
            _bits(t)[lo : hi + 1].zero_()


def copy_blocks(caches: list[tuple[torch.Tensor, ...]], src_ids: list[int], dst_ids: list[int]) -> None:
    """Block ``src_ids[i]`` of every layer's tensors (codes and scales) copied over block ``dst_ids[i]``, in
    the pool: on CPU through the block-copy kernel, elsewhere (or without it) one indexed copy per tensor."""
    if not src_ids:
        return
    if caches[0][0].device.type == "cpu":
        from sidecar.model.kernels.cpu import block_copy

        if block_copy.copy_blocks([_bits(t) for layer in caches for t in layer], src_ids, dst_ids):
            return
    dev = caches[0][0].device
    src = torch.tensor(src_ids, dtype=torch.long, device=dev)
    dst = torch.tensor(dst_ids, dtype=torch.long, device=dev)
    for layer in caches:
        for t in layer:
            b = _bits(t)
            b.index_copy_(0, dst, b.index_select(0, src))


def block_nbytes(caches: list[tuple[torch.Tensor, ...]]) -> int:
    """Bytes of one block across every layer's tensors (values and scales): one offloaded block."""
    return sum(t[0].numel() * t.element_size() for layer in caches for t in layer)


def read_block(caches: list[tuple[torch.Tensor, ...]], block_id: int) -> torch.Tensor:
    """Block ``block_id`` of every layer's tensors, in order, as one uint8 tensor on the host."""
    if caches[0][0].device.type == "cpu":
        from sidecar.model.kernels.cpu import block_copy

        data = block_copy.gather_block([_bits(t) for layer in caches for t in layer], block_id)
        if data is not None:
            return data
    parts = [t[block_id].reshape(-1).view(torch.uint8) for layer in caches for t in layer]
    return torch.cat(parts).cpu()


def write_block(caches: list[tuple[torch.Tensor, ...]], block_id: int, data: torch.Tensor) -> None:
    """The inverse of ``read_block``: ``data`` (uint8, ``block_nbytes`` long) into block ``block_id``."""
    write_blocks(caches, [block_id], [data])


def write_blocks(caches: list[tuple[torch.Tensor, ...]], block_ids: list[int], datas) -> None:
    """``write_block`` for many blocks at once: one indexed copy per cache tensor for all of them (a long
    prefix loads in as many copies as the cache has tensors, not that times its blocks). ``datas``: a list
    of block buffers, or one uint8 tensor [n, block bytes] (already staged)."""
    need = block_nbytes(caches)
    for data in datas:  # checked first: a bad buffer writes nothing
        if data.dtype != torch.uint8 or data.numel() != need:
            raise ValueError(f"block data: {data.numel()} bytes of {data.dtype} for a block of {need} bytes")
    if len(datas) != len(block_ids):
        raise ValueError(f"block data: {len(datas)} buffers for {len(block_ids)} blocks")
    if not len(datas):
        return
    first = caches[0][0]
    if not isinstance(datas, torch.Tensor) and first.device.type == "cpu":
        from sidecar.model.kernels.cpu import block_copy

        if block_copy.scatter_blocks([_bits(t) for layer in caches for t in layer], block_ids, datas):
            return
    if isinstance(datas, torch.Tensor):
        rows = datas
    else:
        rows = torch.stack(datas) if len(datas) > 1 else datas[0][None]
    rows = rows.to(first.device, non_blocking=True)
    ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    off = 0
    for layer in caches:
        for t in layer:
            dst = _bits(t)
            n = dst[0].numel() * dst.element_size()
            src = rows[:, off : off + n].contiguous().view(dst.dtype).view(len(datas), *dst.shape[1:])
            dst.index_copy_(0, ids, src)
            off += n
