"""Device fast paths on every pipeline stage (pp.py): each stage's self-check over its own layers and its own
decode graphs, one decision for the pipeline.

A stage's forward holds no collective (the residual stream goes stage to stage between forwards), so each
stage checks and captures on its own, all at once: rank 0 sends its decode buffers' dimensions and every stage
builds a ``StageRunner`` over its layers and pool and runs ``self_check.run`` on it. A stage's probe forward is
its layers over a stream standing for the stages before it (stage 0: the embedded tokens; a later stage: seeded
rows picked by token id, the same rows in every run the check compares), and its "logits" are the last
stage's head's, another stage's the stream it hands on (in float32): what the next stage would receive. Each
stage reports the paths that passed and its reasons; rank 0 keeps a path on where every stage passed it (else
the reason names each failing stage: "stage 1: ..."), every stage turns on that set and captures its graphs for
the padded buckets of rank 0's ``max_batch`` (``cuda_graphs``), and where one stage's capture fails every
stage drops its graphs. ``PipelineParallel.device_checks`` keeps each stage's own reasons.

Serving (``run_part``): a plain decode part -- ``pp_replay.StagePlans.load``'s kind -- is copied into the
stage's buffers (rows from 0; stage 0's token ids, a later stage's received stream), padded to its bucket
(padded rows as ``DecodeInputs.fill``'s: token 0 at position 0 writing the reserved block 0), and its bucket's
graph replayed (eagerly where none is captured, e.g. on a CPU); its first rows are the stream handed on. The
graph reads only the buffers: the same addresses on every replay. Other parts run eagerly through
``run_layers``, with the same paths on. With no collective inside a stage's step, the buckets need not match
across stages: a part's rows are counted alike on both sides of each send.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Optional

import torch

from sidecar.engine import self_check
from sidecar.engine.graphs import DecodeGraphs, capture_or_none
from sidecar.engine.input_buffers import (
    DecodeInputs,
    decode_buckets,
    decode_metadata,
    pick_bucket,
    table_width,
)
from sidecar.engine.tp_device import compose
from sidecar.model.kernels.gpu_paths import PATH_NAMES, FastPaths
from sidecar.model.pp_stage import final_logits, run_layers

log = logging.getLogger("sidecar.engine")

SEED, ROWS = 11, 64  # a later stage's probe stream: ROWS seeded rows, row ``id % ROWS`` for token ``id``


class StageProbe:
    """``self_check``'s view of a stage's model: a forward is the stage's layers over the probe stream (returned
    stacked, ``[2, T, H]``), ``logits_at`` the last stage's logits or another stage's stream rows."""

    def __init__(self, runner: "StageRunner") -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner.core, name)

    def __call__(self, ids, positions, kv_caches, meta) -> torch.Tensor:
        r = self._runner
        h, delta = r.stream_of(ids)
        return torch.stack(run_layers(r.core, r.stage, h, delta, positions, kv_caches, meta))

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        r = self._runner
        if r.stage.last:
            return final_logits(r.core, hidden[0], hidden[1], rows)
        return torch.cat((hidden[0], hidden[1]), -1).index_select(0, rows).float()


class StageRunner:
    """One stage's decode graphs over persistent buffers of rank 0's dimensions (``dims``: max batch, max
    blocks, block size, pool blocks), and what the self-check needs of it. ``model``: the whole model built with
    the other stages' layers as ``nn.Identity``; ``kv_caches``: its layers' caches in layer order; ``loaded``:
    its ``device``, ``dtype`` and ``quantized`` (rank 0's runner, or a worker's ``worker_view``)."""

    def __init__(self, model: Any, stage: Any, kv_caches: list, loaded: Any, dims: tuple) -> None:
        max_batch, max_blocks, self.block_size, self.num_blocks = dims
        self.core, self.stage, self.kv_caches = model, stage, kv_caches
        self.device, self.dtype, self.quantized = loaded.device, loaded.dtype, bool(loaded.quantized)
        if getattr(model, "fast_paths", None) is None:
            model.fast_paths = FastPaths()
        self.fast_paths: FastPaths = model.fast_paths
        self.model = StageProbe(self)
        self.inputs = DecodeInputs(max_batch, max_blocks, self.block_size, self.device)
        size = model.args.hidden_size
        self.stream = torch.zeros(2, max_batch, size, dtype=self.dtype, device=self.device)
        gen = torch.Generator().manual_seed(SEED)
        self.probe_rows = (torch.randn(2, ROWS, size, generator=gen) * 0.5).to(self.device, self.dtype)
        self.graphs = DecodeGraphs(self.step, self.device)
        self.on = False  # serving through ``run_part`` (the group's decision)
        self.set_decode_padding(False)

    def stream_of(self, ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The probe's input stream of tokens ``ids``: embedded on stage 0, seeded rows on a later stage."""
        if self.stage.first:
            return self.core.embed(ids), None
        rows = self.probe_rows.index_select(1, ids % ROWS)
        return rows[0], rows[1]

    def step(self, bucket: int) -> torch.Tensor:
        """The stage's layers over the buffers' first ``bucket`` rows: the function its graphs capture (no host
        reads). Returns the stream it hands on, stacked ``[2, bucket, H]``."""
        i = self.inputs
        if self.stage.first:
            h, delta = self.core.embed(i.ids[:bucket]), None
        else:
            h, delta = self.stream[0, :bucket], self.stream[1, :bucket]
        meta = decode_metadata(i, bucket)
        if self.fast_paths.attention:
            meta.decode_block_tables_i32 = i.tables_int32(bucket, i.width)
        return torch.stack(
            run_layers(self.core, self.stage, h, delta, i.positions[:bucket], self.kv_caches, meta)
        )

    def set_decode_padding(self, padded: bool) -> None:
        self.buckets = decode_buckets(self.inputs.max_batch, padded)

    def fits_decode_buffers(self, n: int, width: int) -> bool:
        return n <= self.inputs.max_batch and width <= self.inputs.max_blocks

    def decode_rows(self, rows: list, sample: list) -> torch.Tensor:
        """The self-check's decode step: the rows through the buffers and the graphs (a later stage's stream the
        probe rows of their tokens), the "logits" of rows ``sample``."""
        bucket = pick_bucket(self.buckets, len(rows))
        width = self.inputs.max_blocks if bucket in self.graphs.captured else table_width(rows)
        self.inputs.fill(rows, sample, bucket, width)
        if not self.stage.first:
            ids = self.inputs.ids[:bucket]
            self.stream[:, :bucket].copy_(self.probe_rows.index_select(1, ids % ROWS))
        return self.model.logits_at(self.graphs.run(bucket), self.inputs.sample_rows[: len(sample)])

    def check(self) -> tuple[list[str], dict]:
        """This stage's own self-check: the paths that passed, the reasons of those that did not."""
        self_check.run(self, self_check.default_paths(self))
        self.graphs.clear()
        return self.fast_paths.active(), dict(self.fast_paths.reasons or {})

    @torch.inference_mode()
    def apply(self, paths: list[str], reasons: dict) -> Optional[str]:
        """Turn on the group's ``paths`` (``reasons`` for the others) and capture the graphs where
        ``cuda_graphs`` is among them; returns why capture failed (None: it did, or was not asked)."""
        fp = self.fast_paths
        self.graphs.clear()
        fp.set_all(False)
        fp.reasons = dict(reasons)
        for name in paths:
            setattr(fp, name, True)
        self.on = bool(paths)
        self.set_decode_padding(fp.cuda_graphs)
        if not fp.cuda_graphs:
            return None
        wide = self.inputs.max_blocks
        return capture_or_none(self.graphs, self.buckets, lambda b: self.inputs.fill_padding(b, wide))

    @torch.inference_mode()
    def run_part(self, ids, positions, meta, stream=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The stream ``(h, delta)`` of one micro-batch through the stage's graph (views of its output: read them
        before the next part); None where the paths are off or the part is no plain decode batch."""
        n, tables, i = positions.shape[0], meta.decode_block_tables, self.inputs
        if (
            not self.on
            or meta.prefills
            or tables is None
            or tables.shape[0] != n
            or not 1 <= n <= i.max_batch
            or tables.shape[1] > i.max_blocks
            or meta.layer_metas is not None
            or meta.kv_scores is not None
        ):
            return None
        bucket, bs = pick_bucket(self.buckets, n), self.block_size
        if self.stage.first:
            i.ids[:n].copy_(ids)
            i.ids[n:bucket].zero_()
        else:
            self.stream[:, :n].copy_(torch.stack(stream))
        i.positions[:n].copy_(positions)
        i.slots[:n].copy_(meta.slot_mapping)
        i.ctx_lens[:n].copy_(meta.decode_ctx_lens)
        i.positions[n:bucket].zero_()  # padded rows: token 0 at position 0, written into block 0
        i.slots[n:bucket].copy_(torch.arange(bucket - n, device=i.slots.device) % bs)
        i.ctx_lens[n:bucket].fill_(1)
        wide, w = i.tables(bucket, i.max_blocks), tables.shape[1]  # what a graph reads: max_blocks wide
        wide[:n, :w].copy_(tables)
        wide[:n, w:].zero_()
        wide[n:].zero_()
        i.bucket, i.width, i.scores = bucket, i.max_blocks, None
        out = self.graphs.run(bucket)
        return out[0, :n], out[1, :n]


def refusal(pp: Any, runner: Any) -> Optional[str]:
    """Why no stage takes a device path (None: the stages check them)."""
    if pp.config.enforce_eager:
        return "enforce_eager"
    if runner.states is not None or runner.kv_plan is not None:
        return f"pipeline_parallel_size {pp.world}: state slots or several KV groups"
    return None


def decide(answers: dict[int, tuple[list[str], dict]]) -> tuple[list[str], dict]:
    """The pipeline's paths from each stage's (passed, reasons): on where every stage passed; each other path's
    reason names every stage it failed on with that stage's reason."""
    every = set.intersection(*(set(passed) for passed, _ in answers.values()))
    paths = [p for p in answers[0][0] if p in every]
    names = {n for _, why in answers.values() for n in why} | {p for ps, _ in answers.values() for p in ps}
    reasons = {}
    for name in sorted(names - every):
        said = {r: why[name] for r, (_, why) in answers.items() if name in why}
        reasons[name] = compose_stages(said) if said else "not a path of every stage"
    return paths, reasons


def compose_stages(reasons: dict[int, str]) -> str:
    return compose(reasons, "stage")


def worker_view(loaded: Any) -> Any:
    """A worker's loaded model as ``StageRunner`` reads it."""
    return SimpleNamespace(device=loaded.device, dtype=loaded.dtype, quantized=bool(loaded.quantization))


def start(pp: Any, runner: Any, force: bool = False) -> dict:
    """Once the stages hold their pools: the pipeline's check on CUDA (elsewhere when ``force``: on a CPU our C
    kernels are the fast path); returns the fallbacks."""
    why = refusal(pp, runner)
    if why is not None or not (force or runner.device.type == "cuda"):
        return {}
    stage0 = StageRunner(runner.model._model, runner.model.stage, runner.layer_caches, runner, _dims(runner))
    return check(pp, runner, stage0)


def _dims(runner: Any) -> tuple:
    i = runner.inputs
    return i.max_batch, i.max_blocks, runner.block_size, runner.num_blocks


def check(pp: Any, runner: Any, stage_runner: StageRunner) -> dict:
    """Rank 0's side (module docstring), with stage 0's ``stage_runner``; returns the fallbacks."""
    prior = dict(stage_runner.fast_paths.reasons or {})  # the paths no stage checks keep their reasons
    pp.send(("device", _dims(runner)))
    answers = {0: pp.run(stage_runner.check)}
    for rank in sorted(pp.procs):
        answers[rank] = pp.receive(rank, "device")[1:]
    paths, reasons = decide(answers)
    for name in PATH_NAMES:
        if name not in paths and name not in reasons:
            reasons[name] = prior.get(name, "not checked on the stages")
    pp.device_checks = {r: why for r, (_, why) in answers.items()}
    captures = {}
    for _ in range(2):  # the second time without graphs, where a stage's capture failed
        pp.send(("device_set", paths, reasons))
        captures = {0: pp.run(stage_runner.apply, paths, reasons)}
        for rank in sorted(pp.procs):
            captures[rank] = pp.receive(rank, "device_set")[1]
        failed = {r: why for r, why in captures.items() if why is not None}
        if not failed:
            break
        paths = [p for p in paths if p != "cuda_graphs"]
        reasons["cuda_graphs"] = compose_stages(failed)
        log.warning("decode graphs off on every stage: %s", reasons["cuda_graphs"])
    pp.stage_graphs = stage_runner if stage_runner.on else None
    log.info("pipeline-parallel: fast paths on every stage: %s", ", ".join(paths) or "none")
    return reasons


def worker_message(msg: tuple, runner: Optional[StageRunner], make: Any, conn: Any) -> Optional[StageRunner]:
    """A stage worker's side of the check: ``("device", dims)`` builds its runner (``make(dims)``) and reports
    its own answer, ``("device_set", paths, reasons)`` applies the pipeline's and reports its capture. Returns
    the stage's runner."""
    if msg[0] == "device":
        runner = make(msg[1])
        conn.send(("device", *runner.check()))
    else:
        conn.send(("device_set", runner.apply(msg[1], msg[2])))
    return runner
