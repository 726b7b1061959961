"""Device fast paths on every rank of a tensor-parallel group: each rank's self-check and decode graphs, one
decision for the group.

A rank's forward makes collectives (tp_shard.py: an all-reduce after each row-parallel product and after the
embedding, the head's all-gather), so no rank can probe or capture alone: its peers must make the same
collectives at the same time. The group's check (``check``) therefore runs on every rank at once, in lockstep:
rank 0 sends the workers its decode buffers' dimensions, every rank builds decode inputs of those dimensions
and ``DecodeGraphs`` over its own slices (rank 0 its runner's, a worker ``RankRunner``), and every rank runs
``self_check.run`` over its own slices with ``agree`` (``check_rank``): each path's verdict is asked of the
group before its probe (a rank that cannot take the path -- Triton missing there -- stops every rank from
probing it) and after it. ``agree`` is one all-reduce of a bitmask of the failing ranks, so every rank takes
the same decision and goes on to the same next probe; a failing worker sends its reason over its pipe first,
and rank 0 records the group's reason naming each failing rank ("rank 1: ..."). Then every rank captures its
graphs for the same padded buckets, in the same order (largest first), and agrees again: all ranks capture or
none. Each rank's own reasons are kept (``TensorParallel.device_checks``: rank -> path -> why it failed there).

Capture and collectives: a captured step holds its all-reduces. NCCL collectives issued on the capturing stream
are recorded into the graph (their kernels replay with the step); gloo's are host calls and the shared-memory
all-reduce (tp_shm.py) is a C call that spins on host memory: neither can be captured, so on CUDA the graphs
are refused by name where the group's all-reduce is not NCCL (``capture_refusal``). On a CPU nothing is
captured (``DecodeGraphs`` runs its step eagerly over the same persistent buffers), so the check and the padded
steps run there over gloo or shared memory alike: what the tests exercise.

Buckets: every rank's buckets come from rank 0's ``max_batch`` (``decode_buckets``, padded once graphs are on),
and each replayed step's bucket and rows are rank 0's: it sends them (``tp_replay.pack_rows``: ids, positions,
slots, context lengths, sampled rows, the used columns of the tables) before its own step, each worker writes
them into its buffers and runs the same bucket's graph, so the ranks' collectives pair call for call. A rank
whose probe raises inside a forward leaves its peers in a collective: that breaks the group as an eager step's
failure would (the ranks run the same kernels on slices of one shape, so a kernel fails on all of them alike).

The check runs when the workers are ready (``start``: on CUDA, unless ``enforce_eager``); groups with state
slots or several KV groups keep every path off (``refusal`` names why). Pipeline stages check their own layers
apart (pp_device.py): their forwards hold no collective.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sidecar.engine import self_check
from sidecar.engine.graphs import DecodeGraphs, capture_or_none
from sidecar.engine.input_buffers import DecodeInputs, decode_buckets, decode_step, pick_bucket, table_width
from sidecar.engine.tp_replay import pack_rows, unpack_rows
from sidecar.model.kernels.gpu_paths import PATH_NAMES, FastPaths

log = logging.getLogger("sidecar.engine")

Agree = Callable[[str, Optional[str]], Optional[str]]


def capture_refusal(comm: Any, device: torch.device) -> Optional[str]:
    """Why this rank's decode steps cannot be captured with their all-reduces (None: they can, or nothing is
    captured on this device)."""
    if device.type != "cuda":
        return None
    if comm.shm is not None:
        return "all-reduce over shared memory (a host call spinning on its segment), which a CUDA graph cannot capture"
    import torch.distributed as dist

    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not isinstance(comm.group, nccl):
        return f"all-reduce over {type(comm.group).__name__} (host calls), which a CUDA graph cannot capture"
    return None


def failing_ranks(comm: Any, failed: bool, device: torch.device) -> list[int]:
    """Every rank's ``failed``, as the ranks that failed (one all-reduce of a bitmask; on every rank alike)."""
    flags = torch.zeros(comm.world, dtype=torch.int32, device=device if device.type == "cuda" else "cpu")
    flags[comm.rank] = int(failed)
    comm.wait(comm.group.allreduce([flags]))
    return [r for r, f in enumerate(flags.tolist()) if f]


def compose(reasons: dict[int, str], label: str = "rank") -> str:
    """The group's reason from each failing rank's (``label``: what a rank is called): ranks of one reason named
    together, in rank order."""
    by_reason: dict[str, list[int]] = {}
    for rank in sorted(reasons):
        by_reason.setdefault(reasons[rank], []).append(rank)
    return "; ".join(
        f"{label}{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}"
        for why, rs in by_reason.items()
    )


class RankRunner:
    """What the self-check and capture need of a worker rank: its slices, its KV pool, decode inputs of rank 0's
    dimensions (``dims``: max batch, max blocks, block size, pool blocks) and decode graphs over them."""

    def __init__(self, loaded: Any, kv_caches: list, dims: tuple) -> None:
        max_batch, max_blocks, self.block_size, self.num_blocks = dims
        self.model, self.kv_caches, self.device = loaded.model, kv_caches, loaded.device
        self.dtype, self.quantized = loaded.dtype, bool(loaded.quantization)
        if getattr(self.model, "fast_paths", None) is None:
            self.model.fast_paths = FastPaths()
        self.fast_paths: FastPaths = self.model.fast_paths
        self.inputs = DecodeInputs(max_batch, max_blocks, self.block_size, self.device)
        self.graphs = DecodeGraphs(self.step, self.device)
        self.set_decode_padding(False)

    def step(self, bucket: int) -> torch.Tensor:
        return decode_step(self.model, self.kv_caches, self.inputs, bucket)

    def set_decode_padding(self, padded: bool) -> None:
        self.buckets = decode_buckets(self.inputs.max_batch, padded)

    def fits_decode_buffers(self, n: int, width: int) -> bool:
        return n <= self.inputs.max_batch and width <= self.inputs.max_blocks

    def decode_rows(self, rows: list, sample: list) -> torch.Tensor:
        """``ModelRunner.decode_rows`` for the probe: the rows through the buffers and the graphs, the logits of
        rows ``sample`` (every rank's whole rows: the head gathers them)."""
        bucket = pick_bucket(self.buckets, len(rows))
        width = self.inputs.max_blocks if bucket in self.graphs.captured else table_width(rows)
        self.inputs.fill(rows, sample, bucket, width)
        return self.model.logits_at(self.graphs.run(bucket), self.inputs.sample_rows[: len(sample)])


@torch.inference_mode()
def check_rank(runner: Any, comm: Any, agree: Agree, sampler_check: Any = None) -> None:
    """This rank's side of the group's check, run by every rank at once (module docstring): the capture refusal,
    the self-check, then the capture, each decision agreed. Leaves the rank's paths on as the group decided and
    its graphs captured (padded buckets) where ``cuda_graphs`` stayed on."""
    paths = self_check.default_paths(runner)
    refused = agree("cuda_graphs", capture_refusal(comm, runner.device))
    if refused is not None:
        paths.remove("cuda_graphs")
    self_check.run(runner, paths, sampler_check, agree=agree)
    fp = runner.fast_paths
    if refused is not None:  # after the self-check, which starts with no reasons
        fp.disable("cuda_graphs", refused)
    runner.graphs.clear()
    runner.set_decode_padding(fp.cuda_graphs)
    if not fp.cuda_graphs:
        return
    wide = runner.inputs.max_blocks
    why = capture_or_none(runner.graphs, runner.buckets, lambda b: runner.inputs.fill_padding(b, wide))
    why = agree("cuda_graphs", why)
    if why is not None:
        runner.graphs.clear()
        fp.disable("cuda_graphs", why)
        runner.set_decode_padding(False)
        log.warning("decode graphs off: %s", why)


def worker_agree(comm: Any, conn: Any, device: torch.device, own: dict) -> Agree:
    """A worker's ``agree``: its reason kept in ``own`` and sent to rank 0, then the group's bitmask."""

    def agree(name: str, reason: Optional[str]) -> Optional[str]:
        if reason is not None:
            own[name] = reason
            conn.send(("refused", name, reason))
        ranks = failing_ranks(comm, reason is not None, device)
        return (
            None if not ranks else reason or f"the self-check failed on rank(s) {', '.join(map(str, ranks))}"
        )

    return agree


def worker_check(loaded: Any, kv_caches: list, comm: Any, conn: Any, dims: tuple) -> RankRunner:
    """A worker's side of ``check``: its runner checked and captured with the group; reports to rank 0 its own
    reasons, the paths it holds on and the buckets it captured."""
    runner, own = RankRunner(loaded, kv_caches, dims), {}
    check_rank(runner, comm, worker_agree(comm, conn, runner.device, own))
    conn.send(("device", own, runner.fast_paths.active(), runner.graphs.captured, runner.buckets))
    return runner


def refusal(tp: Any, runner: Any) -> Optional[str]:
    """Why no rank of this group takes a device path (None: the group checks them)."""
    if tp.option != "tensor_parallel_size":
        return f"pipeline_parallel_size {tp.world}: each stage checks its own layers (pp_device.py)"
    if tp.config.enforce_eager:
        return "enforce_eager"
    if runner.states is not None or runner.kv_plan is not None:
        return f"tensor_parallel_size {tp.world}: state slots or several KV groups"
    return None


def start(tp: Any, runner: Any) -> None:
    """After the workers are ready: the group's check on CUDA (on a CPU our C kernels are the fast path)."""
    if runner.device.type == "cuda" and refusal(tp, runner) is None:
        check(tp, runner)


def check(tp: Any, runner: Any) -> dict:
    """Rank 0's side of the group's check (module docstring); returns the fallbacks (path -> the group's
    reason). Call before serving, with no request being stepped."""
    why = refusal(tp, runner)
    if why is not None:
        for name in PATH_NAMES:
            runner.fast_paths.disable(name, why)
        return dict(runner.fast_paths.reasons)
    runner.graphs.clear()  # a previous check's graphs: every rank's paths off, the runner's eager graphs back
    wrapped, eager_graphs = runner.model, runner.graphs
    raw = getattr(wrapped, "_model", wrapped)
    inputs = runner.inputs
    graphs = DecodeGraphs(lambda b: decode_step(raw, runner.layer_caches, inputs, b), runner.device)
    own: dict[str, str] = {}

    def agree(name: str, reason: Optional[str]) -> Optional[str]:
        if reason is not None:
            own[name] = reason
        ranks = failing_ranks(tp.comm, reason is not None, runner.device)
        if not ranks:
            return None
        said = {r: tp._expect(r, "refused") for r in ranks if r != 0}
        assert all(m[1] == name for m in said.values()), (name, said)
        return compose({**({0: reason} if reason is not None else {}), **{r: m[2] for r, m in said.items()}})

    tp.send(("device", (inputs.max_batch, inputs.max_blocks, runner.block_size, runner.num_blocks)))
    runner.model, runner.graphs = raw, graphs  # the probes' forwards: every rank runs its own at once
    try:
        tp.run(check_rank, runner, tp.comm, agree, runner.sampler_check)
    finally:
        runner.model = wrapped
    checks = {0: own}
    for rank in sorted(tp.procs):
        _, theirs, active, captured, buckets = tp.receive(rank, "device")
        checks[rank] = theirs
        mine = [p for p in runner.fast_paths.active() if p != "device_sampler"]
        if (active, captured, buckets) != (mine, graphs.captured, runner.buckets):  # agreed: never differs
            tp.fail(RuntimeError(f"rank {rank} holds paths {active}, graphs {captured}, buckets {buckets}"))
            tp.check()
    tp.device_checks = checks
    if runner.fast_paths.cuda_graphs:
        runner.graphs = RankZeroGraphs(graphs, runner, eager_graphs, tp)
    else:
        runner.graphs = eager_graphs
    log.info("tensor-parallel: fast paths on every rank: %s", ", ".join(runner.fast_paths.active()) or "none")
    return dict(runner.fast_paths.reasons or {})


class RankZeroGraphs:
    """Rank 0's decode graphs in a group whose ranks hold graphs: each step's bucket and rows go to the workers
    first (each runs the same bucket's graph over its buffers), then rank 0 runs its own; a failure breaks the
    group. ``clear`` turns every rank's paths off and gives the runner back its eager graphs (``eager``), which
    drive the workers through the model's forwards."""

    def __init__(self, graphs: DecodeGraphs, runner: Any, eager: DecodeGraphs, tp: Any) -> None:
        self.graphs, self.runner, self.eager, self._tp = graphs, runner, eager, tp

    @property
    def captured(self) -> list[int]:
        return self.graphs.captured

    def run(self, bucket: int) -> torch.Tensor:
        self._tp.check()
        self._tp.send(("gstep", pack_rows(self.runner.inputs, bucket)))
        return self._tp.run(self.graphs.run, bucket)

    def clear(self) -> None:
        self.graphs.clear()
        self.runner.fast_paths.set_all(False)
        self.runner.graphs = self.eager
        self.runner.set_decode_padding(False)
        self._tp.send(("device_off",))


def worker_step(runner: RankRunner, packed: tuple) -> torch.Tensor:
    """A worker's replayed step: rank 0's rows into its buffers, then the same bucket's graph (or its eager
    step where the bucket has none: the same collectives either way)."""
    return runner.graphs.run(unpack_rows(runner.inputs, packed))


def worker_off(runner: Optional[RankRunner]) -> None:
    """Rank 0 turned the group's paths off (``RankZeroGraphs.clear``): this worker's too, its graphs dropped."""
    if runner is not None:
        runner.graphs.clear()
        runner.fast_paths.set_all(False)
