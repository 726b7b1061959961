"""The tensor-parallel group's shared-memory all-reduce on one CPU host (``model/kernels/cpu/shm_allreduce``).

When every rank runs on this host's CPUs, rank 0 creates one /dev/shm segment before it spawns the workers
(``offer``) and publishes its name in the group's store under ``KEY`` (an empty value: gloo alone, the reason
logged). After the process group forms, every rank ``join``s: the workers map the segment, a gloo all-reduce
of the ranks' failures then tells each rank that all of them are mapped (rank 0 unlinks the name there, so it
outlives no process however the group ends), and the start-up self-check runs on every rank: shared-memory
sums of float32 and bf16 partials of odd sizes, one longer than a slot, against the fixed-order torch sum of
the same partials (each rank builds every rank's from a seed), bit for bit. A second gloo all-reduce of the
ranks' failures makes the decision one for the whole group: the segment carries the group's float32 / bf16
all-reduces on every rank, or on none (the reason logged) and gloo carries them all, as it carries other dtypes
and every group spread over several hosts. ``SIDECAR_TP_SHM=0`` keeps gloo.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from sidecar.model.kernels.cpu import shm_allreduce as sa
from sidecar.model.loader import resolve_device
from sidecar.model.tp_shard import Comm

log = logging.getLogger("sidecar.engine")

KEY = "shm_all_reduce"


def refusal(config: Any) -> Optional[str]:
    """Why this group's all-reduces cannot go through shared memory (None: they can)."""
    if os.environ.get("SIDECAR_TP_SHM", "1").strip().lower() in ("0", "false", "no", "off"):
        return "switched off by SIDECAR_TP_SHM=0"
    if resolve_device(config.device).type != "cpu":
        return "the ranks are not on the CPU"
    if config.nnodes > 1:
        return f"the ranks are spread over {config.nnodes} hosts"
    if not sa.available():
        return f"shm_allreduce kernel not built: {sa.cpu_build.reason('shm_allreduce')}"
    return None


def offer(config: Any, world: int, store: Any, timeout_s: float) -> tuple[Optional[sa.ShmAllReduce], str]:
    """Rank 0, before spawning: (its mapping, the segment's name), or (None, '') with the reason logged; the
    name (or '') is published under ``KEY`` for the workers."""
    reason, shm, name = refusal(config), None, ""
    if reason is None:
        name = sa.segment_name()
        try:
            shm = sa.ShmAllReduce.create(name, world, timeout_s)
        except OSError as exc:
            reason, name = str(exc), ""
    if reason is not None:
        log.info("tensor-parallel all-reduce over gloo: %s", reason)
    store.set(KEY, name)
    return shm, name


def worker_segment(store: Any) -> str:
    """The segment rank 0 published ('' for none)."""
    return store.get(KEY).decode()


def join(comm: Comm, name: str, shm: Optional[sa.ShmAllReduce], timeout_s: float) -> Optional[str]:
    """Every rank of a group whose rank 0 published segment ``name`` (not ''): map it (the workers; rank 0
    passes its ``shm``), check it, and on every rank alike set ``comm.shm`` or leave gloo in place. Returns the
    reason gloo stays (None when the segment carries the all-reduces)."""
    reason = None
    if shm is None:
        try:
            shm = sa.ShmAllReduce.attach(name, comm.rank, comm.world, timeout_s)
        except OSError as exc:
            reason = str(exc)
    try:
        failed = _count(comm, reason is not None)  # every rank has mapped it, or failed to
    finally:
        if comm.rank == 0:
            sa.unlink(name)
    if failed:
        reason = reason or f"{failed} rank(s) could not map the shared-memory segment"
    else:
        try:
            wrong = self_check(shm, comm.rank, comm.world)
        except sa.ShmAllReduceError as exc:  # a peer's failure aborts the segment for every rank
            wrong = str(exc)
        failed = _count(comm, wrong is not None)
        if failed:
            reason = f"shared-memory all-reduce self-check failed on {failed} rank(s)" + (
                f" (rank {comm.rank}: {wrong})" if wrong else ""
            )
    if reason is not None:
        if shm is not None:
            shm.close()
        log.warning("tensor-parallel rank %d: all-reduce over gloo: %s", comm.rank, reason)
        return reason
    comm.shm = shm
    log.info("tensor-parallel rank %d: all-reduce through shared memory", comm.rank)
    return None


def _count(comm: Comm, failed: bool) -> int:
    """How many ranks pass ``failed`` true (a gloo all-reduce: every rank gets the same count)."""
    flag = torch.tensor([int(failed)], dtype=torch.int32)
    comm.wait(comm.group.allreduce([flag]))
    return int(flag.item())


def check_sizes() -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of the self-check's calls: odd sizes, and one more than a slot holds."""
    sizes = [(dt, n) for dt in sa.DTYPES for n in (1, 7, 897, 4099)]
    return sizes + [(dt, sa.SLOT_BYTES // dt.itemsize + 5) for dt in sa.DTYPES]


def partials(world: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    """Every rank's partial for one self-check call (the same on every rank): values of many magnitudes,
    signs mixed, so the order of the additions shows in the bits."""
    g = torch.Generator().manual_seed(1000 * n + world + (dtype == torch.bfloat16))
    return [
        (torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g))).to(dtype)
        for _ in range(world)
    ]


def fixed_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The reference: rank 0's partial plus rank 1's ... in float32, rounded to the partials' dtype once."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def self_check(shm: sa.ShmAllReduce, rank: int, world: int) -> Optional[str]:
    """Run the check's calls (all of them: the ranks' calls must pair up); None, or what differed on this
    rank."""
    wrong = []
    for dtype, n in check_sizes():
        parts = partials(world, dtype, n)
        got = shm(parts[rank].clone())
        if not same_bits(got, fixed_order_sum(parts)):
            wrong.append(f"{dtype} sum of {n}")
    return f"{', '.join(wrong)} differ(s) from the fixed-order torch sum" if wrong else None
