"""Steps of many rows of a sparse block over int4 experts on the CPU in grouped kernel calls.

``moe_cpu.routed`` runs steps of up to ``moe_cpu.MAX_ROWS`` rows as one-row products, a slot at a time (each
slot reads its expert's weights); a step of more rows (decode batches, prefill chunks) goes through
``sidecar_int4_moe_grouped`` (``kernels/cpu/int4_gemv.c``) instead: in one parallel region the call's slots are
ordered by expert, each picked expert's gate/up blocks run once over all of its slots' rows, then each slot's
silu * up, the down blocks once per expert, and the weighted sums in moe.py's order, so each picked expert's
weights are read once a call. Each expert's products are those its ``Int4Linear`` computes on its rows
(``sidecar_int4_matmul``: the same chunks of rows and kernels; a row's outputs do not depend on the call's other
rows), so the result equals the per-expert loop's bit for bit, however a step is cut into calls.

The kernel's scratch grows with a call's rows times experts per row: a step runs in calls of at most
``Batched.rows`` rows (those whose scratch stays within ``SCRATCH_BYTES``; each call reads its picked experts'
weights again), and the kernel keeps its scratch between calls, so steps do not fault in fresh pages.

Refused (the loop runs the step): more rows than ``int4_gemv.MAX_ROWS`` (an expert of the loop may then take that
many rows, which its layer gives to torch's kernel), and bf16 steps where the experts' layers take the AMX tile
path from ``int4_gemv.TILE_MIN_ROWS`` rows on (another kernel than the one the grouped kernel runs). ``check``
(at load, from ``moe_cpu.self_check``) compares the grouped kernel with the loop on a probe step cut into
several calls and leaves the loop on for a block where they differ, logged.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from sidecar.model.kernels.cpu import int4_gemv
from sidecar.model.kernels.cpu.moe_args import MoeArgs

log = logging.getLogger("sidecar.model")

SCRATCH_BYTES = 64 << 20  # the scratch one grouped call may take; a step of more rows runs in several calls
PROBE_ROWS = 5  # rows per call of check's probe step, so that it runs in several calls


class Batched:
    """The grouped kernel of a block's int4 experts, the activation dtypes it runs and the rows of a call
    (float32 and bf16 alike: float32's, whose scratch is the larger)."""

    __slots__ = ("fn", "dtypes", "rows")

    def __init__(self, fn, dtypes: tuple[torch.dtype, ...], rows: int) -> None:
        self.fn, self.dtypes, self.rows = fn, dtypes, rows


def build(lib, group_size: int, hidden: int, inter: int, k: int, experts: int) -> Optional[Batched]:
    """The grouped kernel for ``experts`` experts of this group size and widths, ``k`` per row (``lib``: the int4
    kernel's library), or None where it does not say its scratch (then the loop runs steps of many rows)."""
    tiles = int4_gemv.tiles_take(group_size, hidden) or int4_gemv.tiles_take(group_size, inter)
    args = MoeArgs(T=1, k=k, E=experts, H=hidden, I=inter, group_size=group_size, x_bf16=0)
    per_row = lib.sidecar_int4_moe_grouped_row_bytes(args)
    if per_row <= 0:
        return None
    dtypes = (torch.float32,) if tiles else (torch.float32, torch.bfloat16)
    return Batched(lib.sidecar_int4_moe_grouped, dtypes, max(1, SCRATCH_BYTES // per_row))


def kernel(batched: Optional[Batched], rows: int, dtype: torch.dtype):
    """(the grouped kernel, rows per call) where it runs a step of ``rows`` rows (past the one-row slots'
    range) in ``dtype``, else None."""
    if batched is None or rows > int4_gemv.MAX_ROWS or dtype not in batched.dtypes:
        return None
    return batched.fn, batched.rows


def check(
    moe: nn.Module,
    batched: Batched,
    x: torch.Tensor,
    routed: Callable[..., Optional[torch.Tensor]],
    reference: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> bool:
    """Whether ``routed`` (the fast path, taking the grouped kernel for the probe rows ``x``, in calls of
    ``PROBE_ROWS`` rows) equals the per-expert loop (``reference``) on them, bit for bit; where not, the
    block's steps of many rows stay with the loop from then on (``batched`` off), logged. Rows of a dtype it
    does not run pass unchecked."""
    if x.dtype not in batched.dtypes:
        return True
    rows, batched.rows = batched.rows, PROBE_ROWS
    try:
        with torch.no_grad():
            weights, ids = moe.route_logits(moe.gate(x), x.dtype)  # torch's router, whatever routes steps
            ids, perm = ids.sort(dim=-1)
            fast = routed(moe, x, weights.gather(-1, perm), ids)
            ok = fast is not None and torch.equal(fast, reference(moe, x))
    finally:
        batched.rows = rows
    if not ok:
        log.warning(
            "moe: the grouped int4 kernel differs from the per-expert loop; the loop runs steps of many rows"
        )
        batched.dtypes = ()
    return ok
