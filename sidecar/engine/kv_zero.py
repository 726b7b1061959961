"""Which KV pool blocks hold zeros, and the pool's commit (its pages made resident) off the start-up path.

A block reads as zeros before anything is written to it: attention kernels may read a block's slots past a
sequence's length under a zero weight, and garbage there (NaN times a zero weight is NaN) would corrupt the
output. The pool is allocated uninitialised (``torch.empty``) and zeroed in two ranges:

- the lazy prefix, blocks ``1..upto``: the block pool hands out never-used blocks in ascending id order, so
  the ids ever used form a prefix ``1..hwm``; every writer (a step, a block copy, a load from the offload
  tiers) calls ``through(max id it writes)`` first, which zeroes the ids between ``upto`` and it;
- the committed suffix, blocks ``top..num_blocks-1``: with ``kv_cache_commit`` on a CPU a background thread
  zeroes the pool from its last block down, a chunk at a time, until it meets the lazy prefix. Writing the
  pages is what commits them (the kernel faults in and clears every page: seconds for a pool of GiBs), so
  start-up no longer waits for it while the resident size still stops growing once the thread is done.

Invariant: every block ``b`` with ``b <= upto`` or ``b >= top`` is zero or holds only KV written since it
was handed out. Both marks move under one lock, and the thread zeroes a chunk while holding it, so a writer
never races the thread over a block. Block 0 (the padding block that padding rows write) is zeroed at start.
Elsewhere than the CPU the whole pool is zeroed at start when committed (device memory clears fast).
"""

from __future__ import annotations

import ctypes
import threading

import torch

# Bytes the background thread zeroes per lock hold (over all layers): a writer waits at most this long.
_CHUNK_BYTES = 8 << 20


class PoolZeroing:
    def __init__(self, caches: list[tuple[torch.Tensor, ...]], num_blocks: int, commit: bool) -> None:
        self.tensors = [
            t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for c in caches for t in c
        ]
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self.upto = 0
        self.top = num_blocks
        self._zero(0, 0)
        self.thread = None
        if not commit or num_blocks <= 1:
            return
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in self.tensors):
            self._zero(1, num_blocks - 1)
            self.top = 1
            return
        per_block = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self._chunk = max(1, _CHUNK_BYTES // max(per_block, 1))
        self.thread = threading.Thread(target=self._commit, name="kv-pool-commit", daemon=True)
        self.thread.start()

    def through(self, top: int) -> None:
        """Blocks ``1..top`` zeroed where never written (call before writing any of them)."""
        if top <= self.upto:
            return
        with self._lock:
            if top > self.upto:
                hi = min(top, self.top - 1)
                if hi > self.upto:
                    self._zero(self.upto + 1, hi)
                self.upto = top

    def rezero(self, lo: int, hi: int) -> None:
        """Blocks ``lo..hi`` written outside the pool's order (a timing probe) set back to zeros."""
        with self._lock:
            self._zero(lo, hi)

    def committed(self) -> bool:
        """Whether every block is zero or written (the background commit is done, or none was asked)."""
        with self._lock:
            return self.top <= self.upto + 1

    def wait(self) -> None:
        """Block until the background commit is done (tests and measurements)."""
        if self.thread is not None:
            self.thread.join()

    def _commit(self) -> None:
        while True:
            with self._lock:
                hi = self.top - 1
                lo = max(hi - self._chunk + 1, self.upto + 1)
                if lo > hi:
                    return
                self._zero(lo, hi, memset=True)
                self.top = lo

    def _zero(self, lo: int, hi: int, memset: bool = False) -> None:
        if lo > hi:
            return
        for t in self.tensors:
            part = t[lo : hi + 1]
            if memset:  # one thread, GIL released: the engine's step keeps its intra-op threads
                ctypes.memset(part.data_ptr(), 0, part.numel() * part.element_size())
            else:
                part.zero_()
