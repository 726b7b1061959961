"""The shared-memory all-reduce of one host's CPU ranks (model/kernels/cpu/shm_allreduce.c,
engine/tp_shm.py), between real processes."""

from __future__ import annotations

import pytest
import torch

from sidecar.engine import tp_shm
from sidecar.model.kernels.cpu import shm_allreduce as sa
from tests.unit.engine import shm_peers

pytestmark = pytest.mark.skipif(not sa.available(), reason="no C compiler for the CPU kernels")


def _start(world: int, scenario: str, timeout_s: float = 60.0, slot_bytes: int = 4096):
    """Rank 0's mapping of a fresh segment (slots of ``slot_bytes``: longer sums go in many chunks), the
    other ranks spawned playing ``scenario``, their queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    name = sa.segment_name()
    shm = sa.ShmAllReduce.create(name, world, timeout_s, slot_bytes)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=shm_peers.run_rank, args=(name, r, world, scenario, out), daemon=True)
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    return name, shm, out, procs


def _stop(name, shm, procs) -> None:
    for p in procs:
        p.kill()
        p.join(10)
    sa.unlink(name)
    shm.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_fixed_order_sum_bit_for_bit(world):
    name, shm, out, procs = _start(world, "sums")
    try:
        mine = [shm_peers.bits(shm(tp_shm.partials(world, dt, n)[0].clone())) for dt, n in shm_peers.CASES]
        checked = tp_shm.self_check(shm, 0, world)
        results = dict([out.get(timeout=120) for _ in procs])
        assert checked is None and all(results[r][1] is None for r in results)  # every rank's self-check
        results = {r: got for r, (got, _) in results.items()}
        results[0] = mine
        for i, (dtype, n) in enumerate(shm_peers.CASES):
            want = shm_peers.bits(tp_shm.fixed_order_sum(tp_shm.partials(world, dtype, n)))
            assert all(results[r][i] == want for r in range(world)), (dtype, n)
        if world > 2:  # the order makes the bits: another order of three partials differs somewhere
            parts, at = (
                tp_shm.partials(world, torch.float32, 100_003),
                shm_peers.CASES.index((torch.float32, 100_003)),
            )
            assert shm_peers.bits(tp_shm.fixed_order_sum(parts[::-1])) != results[0][at]
    finally:
        _stop(name, shm, procs)
    assert not sa.segment_exists(name)


def test_attach_refuses_a_missing_segment_or_another_world():
    name, shm, out, procs = _start(2, "idle")
    try:
        out.get(timeout=120)
        with pytest.raises(OSError, match="a segment for 3 ranks expected"):
            sa.ShmAllReduce.attach(name, 1, 3, 1.0)
        assert sa.segment_exists(name)
    finally:
        _stop(name, shm, procs)
    with pytest.raises(OSError, match="cannot map shared-memory segment"):
        sa.ShmAllReduce.attach(name, 1, 2, 1.0)


def test_peer_that_exits_ends_the_wait_with_an_error():
    name, shm, out, procs = _start(2, "exit")
    try:
        out.get(timeout=120)
        with pytest.raises(sa.ShmAllReduceError, match="exited"):
            shm(torch.ones(10))
        with pytest.raises(sa.ShmAllReduceError, match="aborted"):  # the segment is dead for good
            shm(torch.ones(10))
    finally:
        _stop(name, shm, procs)


def test_silent_peer_times_out_and_abort_reaches_every_rank():
    name, shm, out, procs = _start(2, "idle", timeout_s=0.5)
    try:
        out.get(timeout=120)
        with pytest.raises(sa.ShmAllReduceError, match="timed out"):
            shm(torch.ones(10, dtype=torch.bfloat16))
    finally:
        _stop(name, shm, procs)
    name, shm, out, procs = _start(2, "abort")
    try:
        out.get(timeout=120)
        with pytest.raises(sa.ShmAllReduceError, match="aborted"):
            shm(torch.ones(10))
    finally:
        _stop(name, shm, procs)
