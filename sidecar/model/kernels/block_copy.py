"""Scatter of KV block bytes into the pool without staging (``block_copy.c``).

A chain of offloaded blocks loads back as (block, cache tensor) spans: each block's host bytes hold every
layer's tensors in order (``kv_quant.read_block``), and each span goes straight to its slot in the pool.
Staging the chain in one new buffer first (``torch.stack``) touches as much fresh memory as the chain is
long, and on a 2-core VM a 4,096-token float32 chain spent seconds in that buffer's page faults; the
pool's own memory is already resident. Where the kernel cannot be built the caller stages with torch.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from sidecar.model.kernels import cpu_build
from sidecar.model.kernels.cpu_build import I, P

_KERNEL = cpu_build.Kernel("block_copy", {"sidecar_copy_spans": ([P, P, P, ctypes.c_int64, I], I)})

available = _KERNEL.available


def scatter_blocks(dsts: Sequence[torch.Tensor], block_ids: Sequence[int], datas: Sequence[torch.Tensor]) -> bool:
    """Write each ``datas[i]`` (uint8, contiguous, the byte concatenation of one block of every tensor in
    ``dsts``) into block ``block_ids[i]`` of those tensors ([num_blocks, ...], contiguous, on the CPU).
    False (nothing written) when the kernel is not available; the caller has checked the sizes."""
    lib = _KERNEL.lib()
    if lib is None or not datas:
        return lib is not None
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in dsts) or \
            any(d.device.type != "cpu" or not d.is_contiguous() for d in datas):
        return False
    for b in block_ids:
        if not 0 <= b < dsts[0].shape[0] or any(t.shape[0] != dsts[0].shape[0] for t in dsts):
            raise ValueError(f"scatter_blocks: block {b} is outside a pool of {dsts[0].shape[0]} blocks")
    span = np.array([t[0].numel() * t.element_size() for t in dsts], dtype=np.int64)  # bytes per block
    offs = np.concatenate(([0], np.cumsum(span)[:-1])).astype(np.int64)
    bases = np.array([t.data_ptr() for t in dsts], dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    srcs = np.array([d.data_ptr() for d in datas], dtype=np.int64)
    dst = np.ascontiguousarray((bases[None, :] + ids[:, None] * span[None, :]).reshape(-1))
    src = np.ascontiguousarray((srcs[:, None] + offs[None, :]).reshape(-1))
    lens = np.ascontiguousarray(np.broadcast_to(span, (len(datas), len(span))).reshape(-1))
    rc = lib.sidecar_copy_spans(dst.ctypes.data, src.ctypes.data, lens.ctypes.data, dst.size,
                                torch.get_num_threads())
    return rc == 0
