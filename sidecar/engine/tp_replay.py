"""CPU decode replays on every rank of a tensor-parallel group (``cpu_graphs.py`` on each rank's slices).

A rank's pure-decode step is its decoder over its slices, whose all-reduces are kernel calls of their own
(``kernels/cpu/shm_allreduce.c`` through ``cpu_build.KernelFunction``): a recording notes them like any kernel,
a replay makes them from C, and a dry pass (a plan's, or ``plan_ahead``'s) makes none on any rank. So each rank
records and replays its own plans, and the ranks' all-reduces still pair up call for call: an eager step and a
replayed one make the same all-reduces in the same order. A gloo all-reduce cannot be recorded (it is no kernel
call: ``Comm.all_reduce`` refuses it while a step is recorded), so replays need the shared-memory path.

Start-up (``start``, once the workers hold their pools): where rank 0 may replay (a CPU group on shared memory,
not ``enforce_eager``, no state slots, one KV group), it sends the workers its decode buffers' dimensions; every
rank builds ``DecodeInputs`` of those dimensions and its ``CpuDecodePlans`` and runs the self-check together
(the same steps in the same order on every rank: their eager runs and replays meet in the all-reduces), then a
gloo count of the ranks whose check failed makes one decision: every rank replays, or none (each worker's reason
sent to rank 0, which logs them and keeps the first as ``cpu_decode_replay_reason``). A check whose all-reduce
failed leaves the segment aborted: then the group's all-reduces go over gloo, on every rank alike.

Serving: rank 0's ``RankZeroPlans`` sends each replayed step's rows (ids, positions, slots, context lengths,
sampled rows and the used columns of the block tables) to the workers before its own step; each worker writes
them into its buffers and runs its plan. A failure in a step (a peer gone) breaks the group as an eager step's
would (``TensorParallel.run``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sidecar.engine import tp_shm
from sidecar.engine.cpu_graphs import CpuDecodePlans
from sidecar.engine.input_buffers import DecodeInputs

log = logging.getLogger("sidecar.engine")


def refusal(tp: Any, runner: Any) -> Optional[str]:
    """Why this group's ranks cannot replay decode steps (None: they check whether they can)."""
    if tp.option != "tensor_parallel_size":
        return f"pipeline_parallel_size {tp.world}"
    if tp.config.enforce_eager:
        return "enforce_eager"
    if runner.device.type != "cpu":
        return f"tensor_parallel_size {tp.world}"
    if tp.comm.shm is None:
        return f"tensor_parallel_size {tp.world}: all-reduce over gloo ({tp.shm_reason}), which a replay cannot make"
    if runner.states is not None or runner.inputs.num_groups > 1:
        return f"tensor_parallel_size {tp.world}: state slots or several KV groups"
    return None


def start(tp: Any, runner: Any) -> None:
    """Rank 0's side of the start-up check (module docstring); runs after the workers are ready."""
    reason = refusal(tp, runner)
    if reason is not None:
        runner.cpu_plans.disable(reason)
        return
    i = runner.inputs
    tp.send(("replay", (i.max_batch, i.max_blocks, i.block_size, runner.slot_scores.received.numel())))
    mine = tp.run(_check, runner.cpu_plans, tp.comm)
    reasons = {0: mine}
    for rank in tp.procs:
        reasons[rank] = tp.receive(rank, "checked")[1]
    tp.replay_checks = reasons  # rank -> why its replays are off (None: on)
    failed = {r: why for r, why in reasons.items() if why is not None}
    if failed:
        why = "; ".join(f"rank {r}: {w}" for r, w in sorted(failed.items()))
        runner.cpu_plans.disable(f"tensor_parallel_size {tp.world}: self-check failed on {why}")
        if tp.comm.shm is None:
            tp.shm_reason = f"the replay self-check broke the segment ({why})"
        return
    runner.cpu_plans = RankZeroPlans(runner.cpu_plans, tp)
    log.info("tensor-parallel: CPU decode steps replayed from C on all %d ranks", tp.world)


def _check(plans: CpuDecodePlans, comm: Any) -> Optional[str]:
    """This rank's self-check, then the group's one decision (a gloo count): None where every rank passed,
    else this rank's reason (or that another rank failed); plans off on every rank then."""
    try:
        reason = plans.self_check()
        broken = False
    except tp_shm.sa.ShmAllReduceError as exc:  # a peer's failure aborts the segment on every rank
        reason, broken = f"self-check: {exc}", True
    flags = torch.tensor([int(reason is not None), int(broken)], dtype=torch.int32)
    comm.wait(comm.group.allreduce([flags]))
    failed, broken_anywhere = int(flags[0]), int(flags[1])
    if broken_anywhere and comm.shm is not None:
        comm.shm.close()
        comm.shm = None  # the segment is aborted: gloo from here on, on every rank
    if failed:
        reason = reason or f"another rank's self-check failed ({failed} rank(s))"
        plans.disable(reason)
        return reason
    return None


class RankZeroPlans:
    """Rank 0's ``CpuDecodePlans`` in a group that replays: each step's rows go to the workers first, and its
    run breaks the group on a failure; anything else is the plans' own attribute."""

    def __init__(self, plans: CpuDecodePlans, tp: Any) -> None:
        self._plans, self._tp = plans, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plans, name)

    def replays(self) -> bool:
        return self._plans.replays()

    def run(self, bucket: int) -> torch.Tensor:
        self._tp.check()
        self._tp.send(("decode", pack_rows(self._plans.inputs, bucket)))
        return self._tp.run(self._plans.run, bucket)


def pack_rows(inputs: DecodeInputs, bucket: int) -> tuple:
    """What a worker needs of the buffers' first ``bucket`` rows: the six per-row vectors and the block tables'
    columns any row's context reaches (a replay's tables are ``max_blocks`` wide; the attention kernel reads only
    a row's own context, so later columns need not match). Device buffers are read back (after the step's fill
    and any id gather queued before)."""
    m = inputs.max_batch
    rows = inputs.buffer[: 6 * m].view(6, m)[:, :bucket].cpu().numpy().copy()
    used = int((inputs.ctx_lens[:bucket].max() + inputs.block_size - 1) // inputs.block_size) if bucket else 0
    tables = inputs.tables(bucket, inputs.width)[:, :used].cpu().numpy().copy()
    return bucket, inputs.width, rows, tables


def unpack_rows(inputs: DecodeInputs, packed: tuple) -> int:
    """Write ``pack_rows``' rows into a worker's buffers; returns the bucket."""
    bucket, width, rows, tables = packed
    m = inputs.max_batch
    inputs.buffer[: 6 * m].view(6, m)[:, :bucket].copy_(torch.from_numpy(rows))
    inputs.tables(bucket, width)[:, : tables.shape[1]].copy_(torch.from_numpy(tables))
    inputs.bucket, inputs.width, inputs.scores = bucket, width, None
    return bucket


class WorkerPlans:
    """A worker's buffers and plans, built from rank 0's dimensions; ``check`` runs the group's self-check."""

    def __init__(self, model: Any, kv_caches: list, device: torch.device, dims: tuple) -> None:
        max_batch, max_blocks, block_size, score_slots = dims
        if getattr(model, "fast_paths", None) is None:
            from sidecar.model.kernels.gpu_paths import FastPaths

            model.fast_paths = FastPaths()  # all off: a worker runs our CPU kernels only
        self.inputs = DecodeInputs(max_batch, max_blocks, block_size, device)
        # a scores vector like the one rank 0's runner passes its plans: the same self-check steps (scored ones
        # too; a group never serves a scored step: kv_budget is refused)
        scores = torch.zeros(score_slots, dtype=torch.float32)
        self.plans = CpuDecodePlans(model, kv_caches, self.inputs, None, scores)

    def check(self, comm: Any) -> Optional[str]:
        return _check(self.plans, comm)

    def step(self, packed: tuple) -> torch.Tensor:
        bucket = unpack_rows(self.inputs, packed)
        return self.plans.run(bucket)
