"""Measured prices of decode steps by row count: what speculation weighs a proposal length against.

GEMM kernels change algorithm with the row count and a replayed or captured step costs less than the eager
forward, so the price of verifying k proposed tokens (a step of k + 1 rows) is measured on this device, through
the path ``ModelRunner.execute`` will take for those rows. The rows sit after ``PRICE_CONTEXT`` tokens of context
(where the pool and the buffers hold that many): every verification row attends to its whole context, so rows timed
at positions 0..r-1 would leave each extra row's attention out of its price."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from sidecar.engine.input_buffers import DecodeRow
from sidecar.model.attention import AttentionMetadata

# Context the timed rows follow: about what a request verifying proposals attends to (a prompt to copy from and
# the answer so far), not the empty context of a first token.
PRICE_CONTEXT = 256


@torch.inference_mode()
def time_decode_rows(runner: Any, rows: Union[int, Sequence[int]], repeats: int = 7) -> Optional[list[float]]:
    """Fastest seconds (of ``repeats``) of one forward plus logits for r decode rows, for each r in ``rows`` (an
    int n: r = 1..n), on ``runner`` (the engine's ModelRunner). Rows that fit the decode buffers are timed as
    ``execute`` runs them (the CPU replay or a graph where those are on), the rest through the eager forward.
    Call before serving: it writes the KV of blocks 1.., which are zeroed again. None when the pool is too small."""
    counts = list(range(1, rows + 1)) if isinstance(rows, int) else list(rows)
    bs = runner.block_size
    nb = -(-max(counts) // bs)
    if nb + 1 >= runner.num_blocks:
        return None
    # the context before the rows: PRICE_CONTEXT where blocks 1.., the buffers' tables and the model's context
    # hold it, else less (the tables are a block wider than the longest sequence, rounded up to blocks)
    room = min(runner.num_blocks - 2, runner.inputs.max_blocks - 2) * bs - max(counts)
    c0 = max(0, min(PRICE_CONTEXT, room)) // bs * bs
    nb = -(-(c0 + max(counts)) // bs)
    table = list(range(1, nb + 1))
    # The pool's background commit (kv_zero.py) would share the cores with the steps timed here, and not
    # evenly between row counts: it ends first.
    runner.zeroing.wait()
    runner.zeroing.through(nb)  # the context's blocks read as zeros, as a request's unwritten ones would
    out = []
    for r in counts:
        step = _step(runner, r, table, c0)
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


def _step(runner: Any, r: int, table: list[int], c0: int = 0) -> Callable[[], torch.Tensor]:
    """A step of r rows of one sequence at positions c0..c0+r-1 in blocks ``table`` (block-aligned c0: slot
    ``bs + p`` holds position p), every row sampled."""
    bs = runner.block_size
    if runner.fits_decode_buffers(r, len(table)):
        rows = runner.inputs.one_table(
            [DecodeRow(0, c0 + i, bs + c0 + i, c0 + i + 1, table) for i in range(r)]
        )
        return lambda: runner.decode_rows(rows, list(range(r)))
    tensor = runner.tensor
    meta = AttentionMetadata(slot_mapping=tensor([bs + c0 + i for i in range(r)]), block_size=bs)
    meta.decode_block_tables = tensor(table * r).view(r, len(table))
    meta.decode_ctx_lens = tensor(list(range(c0 + 1, c0 + r + 1)))
    ids, pos, every = tensor([0] * r), tensor(list(range(c0, c0 + r))), tensor(list(range(r)))
    model = runner.model  # logits_at: what a split model (tp.py, pp.py) computes logits through
    return lambda: model.logits_at(model(ids, pos, runner.kv_caches, meta), every)
