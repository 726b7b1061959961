"""A worker rank whose own device check fails, for the tensor-parallel device tests (a module of its own: spawned
processes import their target by name)."""

from __future__ import annotations

from sidecar.engine import self_check, tp_device
from sidecar.engine.tp import _worker_main


def failing_worker(rank, world, port, config, conn) -> None:
    """``tp._worker_main`` on a rank where Triton is missing and capture is refused: its own check fails."""
    self_check.triton_available = lambda: False
    tp_device.capture_refusal = lambda comm, device: "refused on this rank"
    _worker_main(rank, world, port, config, conn)
