"""Measured prices of decode steps by row count: what speculation weighs a proposal length against.

GEMM kernels change algorithm with the row count and a replayed or captured step costs less than the eager
forward, so the price of verifying k proposed tokens (a step of k + 1 rows) is measured on this device, through
the path ``ModelRunner.execute`` will take for those rows."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from sidecar.engine.input_buffers import DecodeRow
from sidecar.model.attention import AttentionMetadata


@torch.inference_mode()
def time_decode_rows(runner: Any, rows: Union[int, Sequence[int]], repeats: int = 7) -> Optional[list[float]]:
    """Fastest seconds (of ``repeats``) of one forward plus logits for r decode rows, for each r in ``rows`` (an
    int n: r = 1..n), on ``runner`` (the engine's ModelRunner). Rows that fit the decode buffers are timed as
    ``execute`` runs them (the CPU replay or a graph where those are on), the rest through the eager forward.
    Call before serving: it writes the KV of blocks 1.., which are zeroed again. None when the pool is too small."""
    counts = list(range(1, rows + 1)) if isinstance(rows, int) else list(rows)
    nb = -(-max(counts) // runner.block_size)
    if nb + 1 >= runner.num_blocks:
        return None
    table = list(range(1, nb + 1))
    # The pool's background commit (kv_zero.py) would share the cores with the steps timed here, and not
    # evenly between row counts: it ends first.
    runner.zeroing.wait()
    out = []
    for r in counts:
        step = _step(runner, r, table)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            step().sum().item()
            times.append(time.perf_counter() - t)
        # The first run warms up; the fastest of the rest is the one least disturbed by anything else running
        # on the machine (a median still moves with a busy neighbour).
        out.append(min(times[1:]))
    runner.zeroing.rezero(1, nb)
    return out


def _step(runner: Any, r: int, table: list[int]) -> Callable[[], torch.Tensor]:
    """A step of r rows of one sequence at positions 0..r-1 in blocks ``table``, every row sampled."""
    bs = runner.block_size
    if runner.fits_decode_buffers(r, len(table)):
        rows = runner.inputs.one_table([DecodeRow(0, i, bs + i, i + 1, table) for i in range(r)])
        return lambda: runner.decode_rows(rows, list(range(r)))
    tensor = runner.tensor
    meta = AttentionMetadata(slot_mapping=tensor([bs + i for i in range(r)]), block_size=bs)
    meta.decode_block_tables = tensor(table * r).view(r, len(table))
    meta.decode_ctx_lens = tensor(list(range(1, r + 1)))
    ids, pos, every = tensor([0] * r), tensor(list(range(r))), tensor(list(range(r)))
    model = runner.model  # logits_at: what a split model (tp.py, pp.py) computes logits through
    return lambda: model.logits_at(model(ids, pos, runner.kv_caches, meta), every)
