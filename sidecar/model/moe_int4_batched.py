"""Batched decode steps of a sparse block over int4 experts on the CPU in one kernel call.

``moe_cpu.routed`` runs steps of up to ``moe_cpu.MAX_ROWS`` rows as one-row products, a slot at a time (each
slot reads its expert's weights); a step of more rows, up to this module's ``MAX_ROWS``, goes through
``sidecar_int4_moe_grouped`` (``kernels/cpu/int4_gemv.c``) instead: in one parallel region the step's slots are
ordered by expert, each picked expert's gate/up blocks run once over all of its slots' rows, then each slot's
silu * up, the down blocks once per expert, and the weighted sums in moe.py's order, so each picked expert's
weights are read once a step. Each expert's products are those its ``Int4Linear`` computes on that many rows
(``sidecar_int4_matmul``: the same chunks of rows and kernels; a row's outputs do not depend on the call's other
rows), so the result equals the per-expert loop's bit for bit.

Refused (the loop runs the step): more rows than ``MAX_ROWS`` (the kernel's scratch grows with rows times experts
per row), and bf16 steps where the experts' layers take the AMX tile path from ``int4_gemv.TILE_MIN_ROWS`` rows on
(another kernel than the one the grouped kernel runs). ``check`` (at load, from ``moe_cpu.self_check``) compares
the grouped kernel with the loop on a probe step and leaves the loop on for a block where they differ, logged.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from sidecar.model.kernels.cpu import int4_gemv

log = logging.getLogger("sidecar.model")

MAX_ROWS = 64  # rows of a step up to which the grouped kernel runs it


class Batched:
    """The grouped kernel of a block's int4 experts and the activation dtypes it runs."""

    __slots__ = ("fn", "dtypes")

    def __init__(self, fn, dtypes: tuple[torch.dtype, ...]) -> None:
        self.fn, self.dtypes = fn, dtypes


def build(lib, group_size: int, hidden: int, inter: int) -> Batched:
    """The grouped kernel for experts of this group size and widths (``lib``: the int4 kernel's library)."""
    tiles = int4_gemv.tiles_take(group_size, hidden) or int4_gemv.tiles_take(group_size, inter)
    return Batched(
        lib.sidecar_int4_moe_grouped, (torch.float32,) if tiles else (torch.float32, torch.bfloat16)
    )


def kernel(batched: Optional[Batched], rows: int, dtype: torch.dtype):
    """The grouped kernel where it runs a step of ``rows`` rows (past the one-row slots' range) in ``dtype``,
    else None."""
    if batched is None or rows > MAX_ROWS or dtype not in batched.dtypes:
        return None
    return batched.fn


def check(
    moe: nn.Module,
    batched: Batched,
    x: torch.Tensor,
    routed: Callable[..., Optional[torch.Tensor]],
    reference: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> bool:
    """Whether ``routed`` (the fast path, taking the grouped kernel for the probe rows ``x``) equals the
    per-expert loop (``reference``) on them, bit for bit; where not, the block's steps of many rows stay with
    the loop from then on (``batched`` off), logged. Rows of a dtype it does not run pass unchecked."""
    if x.dtype not in batched.dtypes:
        return True
    with torch.no_grad():
        weights, ids = moe.route_logits(moe.gate(x), x.dtype)  # torch's router, whatever routes steps
        ids, perm = ids.sort(dim=-1)
        fast = routed(moe, x, weights.gather(-1, perm), ids)
        ok = fast is not None and torch.equal(fast, reference(moe, x))
    if not ok:
        log.warning(
            "moe: the grouped int4 kernel differs from the per-expert loop; the loop runs steps of many rows"
        )
        batched.dtypes = ()
    return ok
