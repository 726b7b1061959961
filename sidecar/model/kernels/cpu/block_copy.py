"""Scatter of KV block bytes into the pool without staging (``block_copy.c``).

A chain of offloaded blocks loads back as (block, cache tensor) spans: each block's host bytes hold every
layer's tensors in order (``kv_quant.read_block``), and each span goes straight to its slot in the pool.
Staging the chain in one new buffer first (``torch.stack``) touches as much fresh memory as the chain is
long, and on a 2-core VM a 4,096-token float32 chain spent seconds in that buffer's page faults; the
pool's own memory is already resident. Where the kernel cannot be built the caller stages with torch.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np
import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_KERNEL = cpu_build.Kernel("block_copy", {"sidecar_copy_spans": ([P, P, P, ctypes.c_int64, I], I)})

available = _KERNEL.available


def _spans(tensors: Sequence[torch.Tensor], block_ids: Sequence[int], buffers: Sequence[torch.Tensor]):
    """(pool addresses, buffer addresses, lengths) of every (block, tensor) span, or None when a tensor or
    buffer is not a contiguous CPU tensor. Raises for a block id outside the pool."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or any(
        d.device.type != "cpu" or not d.is_contiguous() for d in buffers
    ):
        return None
    blocks = tensors[0].shape[0]
    if any(t.shape[0] != blocks for t in tensors):
        raise ValueError("block copy: the cache tensors hold different numbers of blocks")
    for b in block_ids:
        if not 0 <= b < blocks:
            raise ValueError(f"block copy: block {b} is outside a pool of {blocks} blocks")
    span = np.array([t[0].numel() * t.element_size() for t in tensors], dtype=np.int64)  # bytes per block
    offs = np.concatenate(([0], np.cumsum(span)[:-1])).astype(np.int64)
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    bufs = np.array([d.data_ptr() for d in buffers], dtype=np.int64)
    pool = np.ascontiguousarray((bases[None, :] + ids[:, None] * span[None, :]).reshape(-1))
    host = np.ascontiguousarray((bufs[:, None] + offs[None, :]).reshape(-1))
    lens = np.ascontiguousarray(np.broadcast_to(span, (len(buffers), len(span))).reshape(-1))
    return pool, host, lens


def _copy(lib, dst: np.ndarray, src: np.ndarray, lens: np.ndarray) -> bool:
    return (
        lib.sidecar_copy_spans(
            dst.ctypes.data, src.ctypes.data, lens.ctypes.data, dst.size, torch.get_num_threads()
        )
        == 0
    )


def scatter_blocks(
    dsts: Sequence[torch.Tensor], block_ids: Sequence[int], datas: Sequence[torch.Tensor]
) -> bool:
    """Write each ``datas[i]`` (uint8, contiguous, the byte concatenation of one block of every tensor in
    ``dsts``) into block ``block_ids[i]`` of those tensors ([num_blocks, ...], contiguous, on the CPU).
    False (nothing written) when the kernel is not available; the caller has checked the sizes."""
    lib = _KERNEL.lib()
    if lib is None or not datas:
        return lib is not None
    spans = _spans(dsts, block_ids, datas)
    return spans is not None and _copy(lib, spans[0], spans[1], spans[2])


def gather_block(srcs: Sequence[torch.Tensor], block_id: int) -> Optional[torch.Tensor]:
    """Block ``block_id`` of every tensor in ``srcs``, in order, as one new uint8 tensor (``read_block``'s
    bytes) in one call; None when the kernel is not available or the tensors are not contiguous CPU ones."""
    lib = _KERNEL.lib()
    if lib is None:
        return None
    out = torch.empty(sum(t[0].numel() * t.element_size() for t in srcs), dtype=torch.uint8)
    spans = _spans(srcs, [block_id], [out])
    if spans is None or not _copy(lib, spans[1], spans[0], spans[2]):
        return None
    return out


def copy_blocks(tensors: Sequence[torch.Tensor], src_ids: Sequence[int], dst_ids: Sequence[int]) -> bool:
    """Within the pool: block ``src_ids[i]`` of every tensor in ``tensors`` copied over block ``dst_ids[i]``
    (copy-on-write of a block shared by forked sequences). False (nothing copied) when the kernel is not
    available or a tensor is not a contiguous CPU tensor."""
    lib = _KERNEL.lib()
    if lib is None or not src_ids:
        return lib is not None
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    blocks = tensors[0].shape[0]
    for b in list(src_ids) + list(dst_ids):
        if not 0 <= b < blocks:
            raise ValueError(f"block copy: block {b} is outside a pool of {blocks} blocks")
    span = np.array([t[0].numel() * t.element_size() for t in tensors], dtype=np.int64)
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    src = np.ascontiguousarray((bases[None, :] + np.asarray(src_ids, np.int64)[:, None] * span).reshape(-1))
    dst = np.ascontiguousarray((bases[None, :] + np.asarray(dst_ids, np.int64)[:, None] * span).reshape(-1))
    lens = np.ascontiguousarray(np.broadcast_to(span, (len(src_ids), len(span))).reshape(-1))
    return _copy(lib, dst, src, lens)
