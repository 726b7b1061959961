"""Pipeline parallelism: one model's decoder layers split in ``pipeline_parallel_size`` contiguous stages
(model/pp_stage.py), one process each.

This process is stage 0: it schedules, owns the block tables, embeds the step's tokens, runs the first layers
and samples; stages 1..M-1 are worker processes started and watched as tensor parallelism's are (tp.py: the
same spawn, store, process group, pipes and fault handling, with the hooks below). Every stage owns the KV
pool of its own layers only, of rank 0's block count, so rank 0's block tables address every pool alike.

A step: rank 0 sends the forward's inputs (ids, positions, slots, attention metadata) to every worker over its
pipe, runs its layers and sends the residual stream (``h``, ``delta``) to stage 1 with a point-to-point send
of the process group; each stage receives it from the one before, runs its layers and sends it on; the last
stage keeps it. When the step samples, rank 0 sends the rows to the workers and the last stage sends back
their float32 logits (its final norm and head), which rank 0 samples from.

Hybrid models: every stage holds the linear-attention state slots of its own linear layers (rank 0's slot and
checkpoint counts, sent after the pool's size, so a stage without linear layers holds none). Rank 0's
scheduler alone decides which sequence holds which slot and when a state is zeroed, checkpointed or restored
(engine/linear_state.py); each such change of its states (``LinearStates.mirror``) is queued and sent with the
next forward's inputs, and every stage applies the queue, in order, before that forward, so every stage's
slot ``s`` holds the same sequence's state over its own layers. Freeing a slot changes no state: what rank 0
gives back (finish, abort, preemption) is every stage's.

LoRA: every stage's slots hold its own layers' adapter weights; rank 0 mirrors each slot write to the stages
as tp.py does, and each forward's inputs carry the tokens' slots.

Micro-batches (``pipeline_micro_batches``, default one per stage): rank 0 cuts each step's tokens at sequence
boundaries into parts (pp_micro.py) and sends their bounds with the inputs; every stage runs the parts in
order and sends each part's stream on as soon as it is computed without waiting for its receipt, so stage
``k`` works on part ``j`` while stage ``k + 1`` works on part ``j - 1``. A step stays one scheduling unit on
rank 0 (scheduled, then sampled once its last part's logits are back), so a sequence is in one part of one
step in flight and its sampling state never sees two; what does not overlap is rank 0's scheduling and
sampling between steps. With one part the stages run one after another (a step's latency the sum of theirs).
A step with adapter rows runs whole: its adapter slots are set per step, for all of its tokens at once.

CPU decode replays: a stage's forward holds no collective, so each stage replays the pure-decode parts of a
step through its own layers from C (pp_replay.py), stage 0 from the embedded tokens, a later stage from the
stream it received. Every stage checks its replays at start (``check_replays``) and all agree: where one
stage's check fails, every stage runs eagerly and logs why. Rank 0's runner itself stays eager (its model is
this stage driver, not a decoder it could replay whole).

Device fast paths (pp_device.py): on CUDA every stage self-checks the device paths over its own layers and
captures its own decode graphs over persistent buffers; a path is on where every stage passed it, and where one
stage's capture fails no stage keeps graphs. A stage's plain decode parts then go through its bucket's graph
(``StageRunner.run_part``), the stream handed on between replays as between eager parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from sidecar.config import EngineConfig
from sidecar.engine import pp_device
from sidecar.engine.dist_inputs import load_adapter, lora_batch, pack_inputs, unpack_inputs, worker_lora
from sidecar.engine.linear_state import LinearStates
from sidecar.engine.pp_micro import Bounds, micro_batches, micro_meta
from sidecar.engine.pp_replay import StagePlans
from sidecar.engine.rendezvous import run_worker
from sidecar.engine.tp import TensorParallel, TPWorkerLost, join_group
from sidecar.engine.tp_worker import worker_pool
from sidecar.model.attention import AttentionMetadata
from sidecar.model.loader import LoadedModel, load_model
from sidecar.model.pp_stage import Stage, final_logits, run_layers, stage_args
from sidecar.model.tp_shard import Comm

# Point-to-point tags: the stream between stages (part j: TAG_STREAM + 8 * j), the logits back to rank 0.
TAG_STREAM, TAG_LOGITS = 1, 2


def _stream_tag(part: int) -> int:
    return TAG_STREAM + 8 * part


def load(config: EngineConfig) -> tuple["PipelineParallel", LoadedModel]:
    """The started stages and rank 0's loaded model: its layers, driven through ``PipelineModel``."""
    pp = PipelineParallel(config)
    try:
        loaded = load_model(config, shard=pp.shard)
    except BaseException:
        pp.close()
        raise
    return pp, dataclasses.replace(loaded, model=PipelineModel(loaded.model, pp))


class PipelineParallel(TensorParallel):
    """Rank 0's side of the stages (tp.py's TensorParallel with stage slices and the stage worker loop)."""

    option, label = "pipeline_parallel_size", "pipeline-parallel"

    def __init__(self, config: EngineConfig) -> None:
        self.micro_batches = config.pipeline_micro_batches or config.pipeline_parallel_size  # parts a step
        self.split_steps = 0  # steps that ran in more than one part
        self.state_ops: list[tuple] = []  # rank 0's state changes since the last forward (``mirror``)
        self.enforce_eager = config.enforce_eager
        self.plans: Optional[StagePlans] = None  # stage 0's decode replays (``check_replays``)
        self.replay_reason: Optional[str] = "not checked"  # why every stage runs eagerly (None: replays on)
        self.replay_reasons: dict[int, Optional[str]] = {}  # each stage's own self-check answer
        self.stage_graphs: Optional[Any] = None  # stage 0's StageRunner while device paths are on (pp_device)
        super().__init__(config)

    @property
    def worker_main(self) -> Any:
        return _stage_main

    def rank_zero_shard(self, comm: Any) -> Stage:
        return Stage(0, self.world)

    def drive(self, model: Any) -> Any:
        return model  # already the PipelineModel the runner was built on

    def attach(self, runner: Any) -> None:
        """``TensorParallel.attach``, then every stage allocates rank 0's count of state slots and checkpoints
        over its own linear layers, and rank 0's state changes are queued for the stages from then on."""
        super().attach(runner)
        states: Optional[LinearStates] = runner.states
        try:
            self.send(("states", *((states.slots, states.checkpoints) if states is not None else (0, 0))))
            for rank in self.procs:
                self._expect(rank, "ready")
        except BaseException:
            self.close()
            raise
        if states is not None:
            states.mirror = lambda *op: self.state_ops.append(op)
        self.check_replays(runner)
        pp_device.start(self, runner)  # on CUDA: every stage's device paths and graphs, one decision

    def check_replays(self, runner: Any) -> None:
        """Every stage self-checks its CPU decode replays (stage 0 here while the workers check theirs); where
        any stage's check fails (or replays are off for every stage: ``enforce_eager``, not a CPU model, per-layer
        KV groups), every stage runs its steps eagerly, each logging the reason."""
        off = None
        if self.enforce_eager:
            off = "enforce_eager"
        elif runner.device.type != "cpu":
            off = "not a CPU model"
        elif runner.kv_plan is not None:
            off = "a model of several KV groups (each layer's own tables)"
        inputs = runner.inputs
        self.plans = StagePlans(
            runner.model._model,
            Stage(0, self.world),
            runner.layer_caches,
            runner.states,
            inputs.max_batch,
            inputs.max_blocks,
            runner.block_size,
            runner.dtype,
        )
        try:
            self.send(("replay", inputs.max_batch, inputs.max_blocks, off))
            reasons = {0: off or self.plans.self_check()}
            for rank in self.procs:
                reasons[rank] = self._expect(rank, "replay")[1]
        except BaseException:
            self.close()
            raise
        self.replay_reasons = reasons
        failed = [f"stage {rank}: {why}" for rank, why in sorted(reasons.items()) if why is not None]
        self.replay_reason = off or ("; ".join(failed) if failed else None)
        if self.replay_reason is not None:
            if off is None:
                self.send(("replay_off", self.replay_reason))
            self.plans.disable(self.replay_reason)

    def replay_info(self) -> dict:
        """On CPU, ``cpu_decode_replay``: whether every stage replays its decode steps from C (else
        ``cpu_decode_replay_reason`` says why none does), and ``cpu_decode_replay_stages``: each stage's own
        self-check answer (rank -> "" where it passed, else why not)."""
        if self.plans is None or self.replay_reason == "not a CPU model":
            return {}
        return {
            "cpu_decode_replay": self.replay_reason is None,
            "cpu_decode_replay_reason": self.replay_reason or "",
            "cpu_decode_replay_stages": {rank: why or "" for rank, why in self.replay_reasons.items()},
        }

    def replay_counts(self) -> list[int]:
        """How many micro-batches each stage has replayed from C, in stage order."""
        self.send(("replays",))
        return [self.plans.replayed if self.plans else 0] + [
            self._expect(rank, "replays")[1] for rank in sorted(self.procs)
        ]


def send(comm: Comm, t: torch.Tensor, dst: int, tag: int) -> None:
    """Send ``t``'s bytes to rank ``dst`` (any dtype: the receiver knows the shape and dtype)."""
    comm.wait(comm.group.send([t.contiguous().view(torch.uint8).view(-1)], dst, tag), point_to_point=True)


def start_send(comm: Comm, t: torch.Tensor, dst: int, tag: int) -> tuple[Any, torch.Tensor]:
    """Start sending ``t`` to rank ``dst``; returns the operation and the buffer it reads, which must live
    until ``comm.wait`` on the operation returns."""
    buf = t.contiguous().view(torch.uint8).view(-1)
    return comm.group.send([buf], dst, tag), buf


def recv(
    comm: Comm, shape: tuple, dtype: torch.dtype, device: torch.device, src: int, tag: int
) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` that rank ``src`` sent with ``send``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    comm.wait(comm.group.recv([out.view(torch.uint8).view(-1)], src, tag), point_to_point=True)
    return out


class PipelineModel:
    """Rank 0's model under pipeline parallelism: stage 0's layers, then the other stages' through the group.
    ``args`` are stage 0's own (its layer count: what the runner sizes its KV pool by); anything else is the
    model's own attribute."""

    def __init__(self, model: Any, pp: PipelineParallel) -> None:
        self._model, self._pp = model, pp
        self.stage = Stage(0, pp.world)
        self.args = stage_args(model.args, self.stage)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata):
        self._pp.check()
        lora = self._pp.lora
        whole = lora is not None and lora.token_slots is not None  # adapter slots are set per step
        bounds = [(0, ids.shape[0])] if whole else micro_batches(meta, ids.shape[0], self._pp.micro_batches)
        self._pp.split_steps += len(bounds) > 1
        ops, self._pp.state_ops = self._pp.state_ops, []  # applied by every stage before this forward
        self._pp.send(("fwd", pack_inputs(ids, positions, meta, lora), bounds, ops))
        plans = self._pp.stage_graphs if self._pp.stage_graphs is not None else self._pp.plans
        plans = None if whole else plans  # a step with adapter rows runs eagerly on every stage
        return self._pp.run(self._first_stage, ids, positions, kv_caches, meta, bounds, plans)

    def _first_stage(self, ids, positions, kv_caches, meta, bounds: Bounds, plans) -> torch.Tensor:
        m, comm, parts, sent = self._model, self._pp.comm, [], []
        for j, (a, b) in enumerate(bounds):  # part j goes on to stage 1 while part j + 1 runs here
            sub = meta if len(bounds) == 1 else micro_meta(meta, a, b)
            out = plans.run_part(ids[a:b], positions[a:b], sub) if plans is not None else None
            if out is None:
                out = run_layers(m, self.stage, m.embed(ids[a:b]), None, positions[a:b], kv_caches, sub)
            h, delta = out  # a replay's in its arena: sent (stacked, a copy) before the next part replays
            sent.append(start_send(comm, torch.stack((h, delta)), 1, _stream_tag(j)))
            parts.append(h)
        for work, _ in sent:
            comm.wait(work, point_to_point=True)
        # rows stand for the step's tokens; the last stage holds their stream
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self._pp.send(("logits", rows.cpu().numpy()))
        shape = (rows.shape[0], self._model.args.vocab_size)
        last = self._pp.world - 1
        return self._pp.run(recv, self._pp.comm, shape, torch.float32, hidden.device, last, TAG_LOGITS)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TPWorkerLost("pipeline parallelism computes logits of selected rows only (logits_at)")


def _stage_main(rank: int, world: int, port: int, config: EngineConfig, conn: Any) -> None:
    """A stage worker: join the group, load its layers, allocate their pool, then run what rank 0 sends."""
    run_worker(conn, _stage_body, rank, world, port, config, conn)


def _stage_body(rank: int, world: int, port: int, config: EngineConfig, conn: Any) -> None:
    comm = Comm(join_group(rank, world, port, config), rank, world)
    stage = Stage(rank, world)
    _serve(load_model(config, shard=stage), config, conn, comm, stage)


@torch.inference_mode()
def _serve(loaded: LoadedModel, config: EngineConfig, conn: Any, comm: Comm, stage: Stage) -> None:
    model, device, dtype = loaded.model, loaded.device, loaded.dtype
    kv_caches = worker_pool(loaded, config, conn, stage.kv_shapes(model.args))
    msg = None if kv_caches is None else conn.recv()  # ("states", slots, checkpoints)
    if msg is None:
        return
    local = stage_args(model.args, stage)
    states = LinearStates(local, msg[1], dtype, device, msg[2]) if msg[1] else None
    if states is not None:  # what each of this stage's layers reads: its KV cache or its state slots
        kv_caches = states.layer_caches(local, kv_caches)
    conn.send(("ready",))
    plans: Optional[StagePlans] = None
    ranked: Optional[pp_device.StageRunner] = None  # the stage's device paths and graphs (pp_device.py)
    view = pp_device.worker_view(loaded)
    stream: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    lora = worker_lora(model, config)  # this stage's layers' slots
    shape_of = lambda n: (n, model.args.hidden_size)  # noqa: E731
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "fwd":
            ids, pos, meta, token_slots = unpack_inputs(msg[1], device)
            for op, *rows in msg[3]:  # rank 0's state changes since its last forward, in order
                {"reset": states.reset, "copy": states.copy}[op](*rows)
            on = ranked if ranked is not None and ranked.on else plans
            parts_plans = on if token_slots is None else None  # adapter rows: every stage eager
            with lora_batch(lora, token_slots):
                stream = _run_parts(
                    model, comm, stage, pos, kv_caches, meta, msg[2], shape_of, dtype, parts_plans
                )
        elif msg[0] == "replay":  # (max batch, max blocks, why every stage is eager or None)
            plans = StagePlans(model, stage, kv_caches, states, msg[1], msg[2], config.block_size, dtype)
            reason = msg[3] or plans.self_check()
            if msg[3] is not None:
                plans.disable(msg[3])
            conn.send(("replay", reason))
        elif msg[0] == "replay_off":  # another stage's self-check failed
            plans.disable(msg[1])
        elif msg[0] in ("device", "device_set"):  # the pipeline's device check (pp_device.py)
            make = lambda dims: pp_device.StageRunner(model, stage, kv_caches, view, dims)  # noqa: E731
            ranked = pp_device.worker_message(msg, ranked, make, conn)
        elif msg[0] == "replays":
            conn.send(("replays", plans.replayed if plans is not None else 0))
        elif msg[0] == "lora":
            load_adapter(lora, msg)
        elif msg[0] == "logits" and stage.last:
            rows = torch.from_numpy(msg[1]).to(device)
            send(comm, final_logits(model, *stream, rows), 0, TAG_LOGITS)


def _run_parts(
    model, comm: Comm, stage: Stage, pos, kv_caches, meta, bounds: Bounds, shape_of, dtype, plans=None
):
    """A worker stage's share of one step: each part's stream received (every receive posted at once, so
    the stage before never waits on this one), run through this stage's layers (replayed from C where
    ``plans`` takes the part) and sent on without waiting; the last stage returns the whole step's stream
    ``(h, delta)``, the others None."""
    device = pos.device
    bufs = [torch.empty((2, *shape_of(b - a)), dtype=dtype, device=device) for a, b in bounds]
    pending = [
        comm.group.recv([buf.view(torch.uint8).view(-1)], stage.rank - 1, _stream_tag(j))
        for j, buf in enumerate(bufs)
    ]
    outs, sent = [], []
    for j, ((a, b), buf, work) in enumerate(zip(bounds, bufs, pending)):
        comm.wait(work, point_to_point=True)
        sub = meta if len(bounds) == 1 else micro_meta(meta, a, b)
        out = plans.run_part(None, pos[a:b], sub, (buf[0], buf[1])) if plans is not None else None
        replayed = out is not None
        h, delta = out if replayed else run_layers(model, stage, buf[0], buf[1], pos[a:b], kv_caches, sub)
        if stage.last:  # a replay's result is in its arena, which the next part's replay overwrites
            outs.append((h.clone(), delta.clone()) if replayed else (h, delta))
        else:
            sent.append(start_send(comm, torch.stack((h, delta)), stage.rank + 1, _stream_tag(j)))
    for work, _ in sent:
        comm.wait(work, point_to_point=True)
    if not stage.last:
        return None
    if len(outs) == 1:
        return outs[0]
    return torch.cat([h for h, _ in outs]), torch.cat([d for _, d in outs])
