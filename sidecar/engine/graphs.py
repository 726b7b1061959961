"""Decode steps per batch-size bucket: replayed from captured CUDA graphs, or run eagerly.

``DecodeGraphs`` wraps one step function ``step(bucket) -> hidden [bucket, H]`` that reads its inputs
only from the persistent buffers (``input_buffers.DecodeInputs``). On CUDA ``capture`` records one
graph per bucket (largest first, all sharing one memory pool, each after an eager warm-up run) and
``run`` replays it; everywhere else, and for a bucket not captured, ``run`` calls the step function
itself -- the same function over the same buffers, so the eager form is the graph's reference.

Invariant the step function keeps for capture: no host reads (``.item()``, ``.tolist()``, boolean
indexing, ``nonzero``) and no Python value derived from the buffers' contents, so a replay computes
from whatever the buffers hold at replay time (tests run it on the ``meta`` device to prove this). A hybrid
model's linear layers gather, step and scatter their state slots by the ids in the buffers the same way,
so a replay steps the states of whichever sequences the buffers name (padded rows: the scratch row).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch

log = logging.getLogger("sidecar.engine")

StepFn = Callable[[int], torch.Tensor]


class DecodeGraphs:
    def __init__(self, step: StepFn, device: torch.device) -> None:
        self.step = step
        self.device = device
        self._graphs: dict[int, tuple["torch.cuda.CUDAGraph", torch.Tensor]] = {}
        self._pool = None

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def capture(self, buckets: Iterable[int], prepare: Callable[[int], None]) -> None:
        """Capture one graph per bucket on CUDA (a no-op elsewhere: ``run`` stays eager there).
        ``prepare(bucket)`` fills the buffers with padding rows first, so warm-up and capture touch the
        reserved block 0 only. Raises what capture raises; the caller falls back to eager."""
        if self.device.type != "cuda":
            return
        for b in sorted(set(buckets), reverse=True):  # the largest first: smaller ones fit in its pool
            prepare(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: lazy inits and allocator growth stay out of the graph
                self.step(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.step(b)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("decode graphs captured for batch sizes %s", self.captured)

    def run(self, bucket: int) -> torch.Tensor:
        """Hidden states [bucket, H] of the rows in the buffers. A replay's output tensor is overwritten
        by the next replay of any bucket (shared pool): use it before the next step."""
        entry = self._graphs.get(bucket)
        if entry is None:
            return self.step(bucket)
        graph, out = entry
        graph.replay()
        return out

    def clear(self) -> None:
        """Drop every graph and the pool (before capturing again under other fast-path settings)."""
        self._graphs.clear()
        self._pool = None
        if self.device.type == "cuda" and torch.cuda.is_initialized():  # nothing to wait for otherwise
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def capture_or_none(
    graphs: DecodeGraphs, buckets: Iterable[int], prepare: Callable[[int], None]
) -> Optional[str]:
    """Capture, returning None, or the reason capture failed (the graphs are then cleared)."""
    try:
        graphs.capture(buckets, prepare)
    except Exception as exc:  # any capture failure means eager decode, never a failed start
        graphs.clear()
        return f"capture failed: {type(exc).__name__}: {exc}"
    return None
