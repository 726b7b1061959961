"""Peer ranks for the shared-memory all-reduce tests (a module of its own: spawned processes import their
target by name)."""

from __future__ import annotations

import os
import time

import torch

from sidecar.engine import tp_shm
from sidecar.model.kernels.cpu import shm_allreduce as sa

CASES = [(dtype, n) for dtype in sa.DTYPES for n in (1, 7, 897, 4099, 100_003)]


def run_rank(name: str, rank: int, world: int, scenario: str, out) -> None:
    """Rank ``rank``: map segment ``name``, then play ``scenario``: 'sums' (every case of ``CASES``, then the
    start-up self-check: the results' bytes and the check's answer put on ``out``), 'exit' (leave without a
    call), 'idle' (never call), 'abort'."""
    torch.set_num_threads(1)
    shm = sa.ShmAllReduce.attach(name, rank, world, 60.0)
    if scenario == "sums":
        got = [bits(shm(tp_shm.partials(world, dtype, n)[rank].clone())) for dtype, n in CASES]
        out.put((rank, (got, tp_shm.self_check(shm, rank, world))))
        return
    out.put((rank, scenario))
    if scenario == "exit":
        out.close()
        out.join_thread()  # the message sent before the exit
        os._exit(0)
    if scenario == "abort":
        shm.abort()
    time.sleep(120)


def bits(t: torch.Tensor) -> bytes:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy().tobytes()
