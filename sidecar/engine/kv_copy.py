"""Copies of KV blocks between the pool and host memory, for the offload tiers.

On CPU ``kv_quant`` moves the bytes (our block-copy kernel: every (block, tensor) span copied straight
between the pool and the host buffers); the host tier is simply kept memory. On CUDA both directions run
on a side stream through pinned host memory, so the compute stream never waits for a PCIe transfer it
does not need:
- device -> host (an evicted block): the side stream first waits for the work queued so far (the block's
  last writes), copies into a pinned buffer, and records an event; the compute stream waits for that event
  before anything queued later can reuse the block. A host reader of the bytes (the disk writer) waits
  for the event first (``ready``).
- host -> device (a load): the chain's bytes are staged in one pinned buffer and copied in on the side
  stream; the compute stream waits for its event before the step that reads the blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.model import kv_quant


def ready(data: torch.Tensor) -> None:
    """Block until the copy that fills ``data`` (a ``BlockCopier.read`` result) is done; no-op on CPU."""
    event = getattr(data, "kv_copy_event", None)
    if event is not None:
        event.synchronize()


class BlockCopier:
    """``read(block_id)`` / ``write(block_ids, datas)`` over a runner's layer caches on ``device``."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]], device: torch.device) -> None:
        self.caches = caches
        self.device = device
        self.stream: Optional["torch.cuda.Stream"] = (
            torch.cuda.Stream(device) if device.type == "cuda" else None
        )

    def read(self, block_id: int) -> torch.Tensor:
        if self.stream is None:
            return kv_quant.read_block(self.caches, block_id)
        parts = [t[block_id].reshape(-1).view(torch.uint8) for layer in self.caches for t in layer]
        out = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, pin_memory=True)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            off = 0
            for p in parts:
                out[off : off + p.numel()].copy_(p, non_blocking=True)
                off += p.numel()
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)  # the block is rewritten only after its bytes have left
        out.kv_copy_event = event
        return out

    def write(self, block_ids: list[int], datas: list[torch.Tensor]) -> None:
        if self.stream is None or not datas:
            kv_quant.write_blocks(self.caches, block_ids, datas)
            return
        for d in datas:
            ready(d)  # bytes still arriving from an eviction copy
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # earlier work on these blocks (lazy zeroing) comes first
        with torch.cuda.stream(self.stream):
            staged = torch.empty((len(datas), datas[0].numel()), dtype=torch.uint8, pin_memory=True)
            torch.stack(datas, out=staged)
            kv_quant.write_blocks(self.caches, block_ids, staged)
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)  # the next step reads the blocks only after they arrived
