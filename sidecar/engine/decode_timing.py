"""The measured price of a decode step of r rows on this device (speculative decoding's cost model)."""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import torch

from sidecar.model.attention import AttentionMetadata


@torch.inference_mode()
def time_decode_rows(runner, rows: Union[int, Sequence[int]], repeats: int = 7) -> Optional[list[float]]:
    """Fastest seconds (of ``repeats``) of one forward plus logits for r decode rows, for each r in
    ``rows`` (an int n: r = 1..n): the price of verifying r - 1 speculative tokens of one request, or
    of a batch's rows, on this device (GEMM kernels change algorithm with the row count, so the price
    is measured, not assumed). Call before serving: it writes the KV of blocks 1.., which the lazy
    zeroing clears before their first real use. None when the pool is too small."""
    counts = list(range(1, rows + 1)) if isinstance(rows, int) else list(rows)
    max_rows = max(counts)
    bs = runner.block_size
    nb = -(-max_rows // bs)
    if runner._zeroed_upto > 0 or nb + 1 >= runner.num_blocks:
        return None
    table = list(range(1, nb + 1))
    out = []
    for r in counts:
        meta = AttentionMetadata(slot_mapping=runner._tensor([bs + i for i in range(r)]), block_size=bs)
        meta.decode_block_tables = runner._tensor(table * r).view(r, nb)
        meta.decode_ctx_lens = runner._tensor(list(range(1, r + 1)))
        ids, pos = runner._tensor([0] * r), runner._tensor(list(range(r)))
        times = []
        for i in range(repeats + 1):
            t = time.perf_counter()
            runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta)).sum().item()
            times.append(time.perf_counter() - t)
        # The first run warms up; the fastest of the rest is the one least disturbed by anything else
        # running on the machine (a median still moves with a busy neighbour).
        out.append(min(times[1:]))
    return out
