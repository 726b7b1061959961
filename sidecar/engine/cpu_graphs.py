"""CPU decode steps replayed from C: the CPU's form of decode graphs (``model/kernels/cpu/replay.py``).

A pure-decode step reads its rows from the persistent buffers (``input_buffers.DecodeInputs``). Here the
part of it that runs outside our kernels -- the embedding lookup and the rope rows of the positions, a
few torch operators -- is done first into persistent buffers of its own (``stage``), and the decoder over
them (``CausalLM.forward_embedded``), all in our kernels, is the part recorded once per batch
size and replayed from C afterwards: the same kernels with the same operands, without the step's Python
calls, checks and allocations around them.

Every batch size is planned before its first step -- sizes up to ``PLAN_AHEAD`` when the engine starts
(``plan_ahead``), larger ones when first seen: the step's Python runs with every kernel call noted and none made
(``replay.record(dry=True)``: nothing computed or written), and the plan is replayed from the size's first
step. On the CPU each size is its own bucket, and a workload whose batch shrinks as requests finish meets
dozens of them; recording each at its first step instead would run it eagerly once, and then record it (an
eager run noting its calls), a cost every size pays in the workload's first rounds. A size that cannot
be planned so (its step runs a torch operator, or keeps what it allocated) is recorded at its first step and
replayed from then on. One scratch arena holds every plan's intermediate tensors; plans are replayed one at a
time by the engine's one thread. The block tables are ``max_blocks`` columns wide in every step while replays
are on (a plan holds the width it was recorded with; the attention kernel reads only a row's own context).

A hybrid model's linear-attention layers step their rows' state slots in place (``deltanet_step.c``): the slot
of each row is read from the buffers (``DecodeInputs.state_slots``) like its KV slot, so a plan steps whichever
sequences the buffers name. The self-check points its padded rows at slots ``0..bucket-1`` (not the scratch row),
set to the same random states before each run it compares (the states after it compared too), then at rest.

A mixture-of-experts block is recorded where its decode step runs in kernels alone (the gate, the router kernel,
the grouped int8 / int4 / bf16 experts: ``model/moe_cpu.py``); elsewhere it runs a torch operator, which the
self-check names. A tensor-parallel rank's all-reduces are kernel calls too (``shm_allreduce.c``; ``tp_replay.py``).

A scored step (``DecodeInputs.scores`` set: h2o eviction) adds the attention each key receives to the slot
scores from the attention kernel; the vector is allocated once, so its address is an operand like the KV
cache's, and a scored step has plans of its own (the same sizes, one more argument to each attention call).
The slots it writes are reset before the step, outside the plan (``ModelRunner.decode_rows``).

Before serving, ``self_check`` records and replays a step and compares its hidden states with the eager
run's, bit for bit (the same kernels on the same inputs), and plans it dry: the plan must make the
recording's calls and replay to the same bits, or sizes are recorded, not planned (``plans_dry`` off,
``dry_reason`` says why). Where a replay differs, where a one-row step runs a torch operator (a configuration
whose layers take torch paths: float32 layers in oneDNN, the torch fallbacks) or where the replay cannot be
built, every step runs eagerly and ``reason`` says why. A batch size whose step runs a torch operator (bf16
batches past our kernel's rows go to oneDNN where it has bf16) runs eagerly alone (``eager_sizes``). The
self-check checks the scored form the same way, its scores compared too; where it fails scored steps alone run
eagerly (``scored_reason``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sidecar.engine.input_buffers import DecodeInputs, decode_metadata
from sidecar.model.kernels.cpu import replay
from sidecar.model.linear_layout import linear_layouts
from sidecar.model.quant_format import release_freed_memory

# Batch sizes planned when the engine starts (larger ones when first seen): every size costs a dry pass, dearer
# past the sizes whose allocations the heap serves, so planning all of a large max_num_seqs ahead would make up
# most of the load (figures: docs/perf/code-notes.md).
PLAN_AHEAD = 64
# Dry passes between which the freed heap is handed back: glibc keeps what the passes free resident, many times
# what the plans themselves hold (figures: docs/perf/code-notes.md).
TRIM_EVERY = 8

log = logging.getLogger("sidecar.engine")


class CpuDecodePlans:
    def __init__(
        self, model, kv_caches: list, inputs: DecodeInputs, states=None, scores: Optional[torch.Tensor] = None
    ) -> None:
        """``kv_caches``: what each layer's mixer reads; ``states``: a hybrid model's ``LinearStates`` (whose
        rows the self-check's padded rows step), else None; ``scores``: the vector scored steps add to (the
        self-check's scored steps zero it), None: no step is scored."""
        self.model, self.kv_caches, self.inputs, self.states = model, kv_caches, inputs, states
        self.scores = scores
        self.on_cpu = inputs.device.type == "cpu"
        self.enabled = False
        # why steps run eagerly (None: replays are on)
        self.reason: Optional[str] = "not checked" if self.on_cpu else "not a CPU model"
        # keyed by (batch size, scored): a scored step's plan passes the scores to its attention calls
        self._plans: dict[tuple[int, bool], replay.Plan] = {}
        self._seen: set[tuple[int, bool]] = set()
        # why a size's step cannot be recorded (it runs eagerly)
        self._eager: dict[tuple[int, bool], str] = {}
        self.plans_dry = False  # a size seen first is planned dry and replayed (self_check turns it on)
        self.dry_reason: Optional[str] = "not checked"
        self.scored_reason: Optional[str] = "not checked"  # why scored steps run eagerly (None: replayed)
        self._scored_dry = False  # scored sizes planned dry when first seen
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._hidden: Optional[torch.Tensor] = None
        self._rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._eager_states: list[torch.Tensor] = []  # the self-check's eager step's states after it
        self._eager_scores: Optional[torch.Tensor] = None  # and the scores of a scored one
        self.replayed = 0  # steps served by a plan's replay

    @property
    def recorded(self) -> list[int]:
        """Batch sizes whose unscored steps have a plan."""
        return sorted(b for b, scored in self._plans if not scored)

    @property
    def recorded_scored(self) -> list[int]:
        """Batch sizes whose scored steps have a plan."""
        return sorted(b for b, scored in self._plans if scored)

    @property
    def eager_sizes(self) -> dict[int, str]:
        """Batch sizes whose unscored steps run eagerly, and why (e.g. bf16 batches past our kernel's rows,
        which oneDNN takes where it has bf16)."""
        return {b: why for (b, scored), why in self._eager.items() if not scored}

    @property
    def arena_bytes(self) -> int:
        return self._arena.numel()

    def stage(self, bucket: int) -> None:
        """The step's inputs outside the decoder: embeddings and rope rows of the buffers' rows."""
        inputs = self.inputs
        rows = self.model.embed(inputs.ids[:bucket])
        if self._hidden is None or self._hidden.dtype != rows.dtype:
            m, cos = inputs.max_batch, self.model.rope_cos  # [rope kinds, positions, rotary dims]
            self.clear()  # plans hold these buffers' addresses
            self._hidden = torch.empty(m, rows.shape[-1], dtype=rows.dtype)
            self._rope = (
                torch.empty(cos.shape[0], m, 1, cos.shape[-1], dtype=cos.dtype),
                torch.empty(cos.shape[0], m, 1, cos.shape[-1], dtype=cos.dtype),
            )
        self._hidden[:bucket].copy_(rows)
        self.model.rope_rows(inputs.positions[:bucket], out=self._rope)

    def body(self, bucket: int) -> torch.Tensor:
        """The decoder over the staged rows, eagerly: the step a plan records."""
        cos, sin = self._rope
        return self.model.forward_embedded(
            self._hidden[:bucket],
            cos[:, :bucket],
            sin[:, :bucket],
            self.kv_caches,
            decode_metadata(self.inputs, bucket),
        )

    def replays(self) -> bool:
        """Whether decode steps go through ``run`` now (on, and no device fast path -- Triton under its
        interpreter in tests -- active: those steps are not the recorded ones)."""
        return self.enabled and not self.model.fast_paths.active()

    def run(self, bucket: int) -> torch.Tensor:
        """Hidden states [bucket, H] of the rows in the buffers: replayed when a plan exists (planned ahead, or
        planned dry when first seen), else eagerly (recording a plan the second time a batch size is seen). The
        result of a replay is overwritten by the next step."""
        self.stage(bucket)
        scored = self.inputs.scores is not None
        if not self.enabled or (scored and self.scored_reason is not None):
            return self.body(bucket)
        key = (bucket, scored)
        plan = self._plans.get(key)
        if plan is None and (self._scored_dry if scored else self.plans_dry) and key not in self._seen:
            self._seen.add(key)
            if self._plan(key) is None:
                plan = self._plans[key]
        if plan is not None:
            if plan.replay(self._arena):
                self.replayed += 1
                return plan.output(self._arena)
            # (a scored step's layers before the refusal have added their scores, and add them again)
            self.disable(f"the {plan.refused} kernel refused its recorded arguments")
            return self.body(bucket)
        if key not in self._seen or key in self._eager:
            self._seen.add(key)
            return self.body(bucket)
        return self._record(key)

    @torch.inference_mode()
    def plan_ahead(self, sizes) -> None:
        """Plan these batch sizes now (dry passes: nothing computed), so that their first steps replay too. A size
        that cannot be planned so is recorded at its first step instead."""
        refused: dict[str, list[int]] = {}
        if self._hidden is None:  # the staging buffers plans read (a dry pass reads no values)
            self.stage(1)
        self.inputs.scores = None
        for i, bucket in enumerate(sizes):
            if (bucket, False) not in self._plans and (bucket, False) not in self._seen:
                self._seen.add((bucket, False))
                why = self._plan((bucket, False))
                if why is not None:
                    refused.setdefault(why, []).append(bucket)
            if i % TRIM_EVERY == TRIM_EVERY - 1:
                release_freed_memory()
        release_freed_memory()
        for why, buckets in refused.items():
            log.info(
                "CPU decode steps of %s rows recorded at their first step, not planned ahead: %s",
                _spans(buckets),
                why,
            )

    def _plan(self, key: tuple[int, bool]) -> Optional[str]:
        """Plan this (size, scored) from a dry pass (nothing computed or written) and keep it; None, or why the
        pass refused it (nothing kept)."""
        try:
            _, plan = replay.record(lambda: self.body(key[0]), dry=True)
        except replay.Unreplayable as exc:
            return str(exc)
        self._keep(key, plan)
        return None

    def _record(self, key: tuple[int, bool]) -> torch.Tensor:
        bucket = key[0]
        if key[1]:  # the recording runs the step: the scores it adds once, not twice
            saved = self.scores.clone()
        try:
            out, plan = replay.record(lambda: self.body(bucket))
        except replay.Unreplayable as exc:  # this size stays eager; the step runs again (the same KV writes)
            self._eager[key] = str(exc)
            log.info("CPU decode steps of %d rows%s run eagerly: %s", bucket, " (scored)" * key[1], exc)
            if key[1]:
                self.scores.copy_(saved)
            return self.body(bucket)
        self._keep(key, plan)
        return out

    def _keep(self, key: tuple[int, bool], plan: replay.Plan) -> None:
        self._plans[key] = plan
        if plan.arena_bytes > self._arena.numel():
            self._arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)

    def info(self) -> dict:
        """On CPU, ``cpu_decode_replay``: whether decode steps are replayed from C, and
        ``cpu_decode_replay_reason``: why not; ``cpu_decode_planned``: whether a size is planned when first seen
        (``cpu_decode_planned_reason``: why not); ``cpu_linear_layouts``: how the linear layers hold their
        weights (``linear_layouts``); elsewhere nothing."""
        if not self.on_cpu:
            return {}
        return {
            "cpu_decode_replay": self.enabled,
            "cpu_decode_replay_reason": self.reason or "",
            "cpu_decode_planned": self.plans_dry,
            "cpu_decode_planned_reason": self.dry_reason or "",
            "cpu_linear_layouts": linear_layouts(self.model),
        }

    def disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("CPU decode replays off, steps run eagerly: %s", reason)
        self.enabled = self.plans_dry = self._scored_dry = False
        self.reason = self.dry_reason = self.scored_reason = reason
        self.clear()

    def clear(self) -> None:
        self._plans.clear()
        self._seen.clear()
        self._eager.clear()
        self._arena = torch.empty(0, dtype=torch.uint8)

    @torch.inference_mode()
    def self_check(self) -> Optional[str]:
        """Turn replays on when a recorded step replays to the eager step's bits; returns None, or why they
        stay off. A step of one row must record; one of two rows is checked where it records (where it does
        not, that size runs eagerly when serving). Each recorded size is planned dry too: sizes are planned
        ahead when serving (``plans_dry``) where every such plan makes the recording's calls and replays to the
        eager bits. Call before serving: its steps are padding rows, which write the reserved block 0 only."""
        self.clear()
        self.enabled = self.plans_dry = False
        reason = replay.unavailable_reason() if self.on_cpu else "not a CPU model"
        reason = reason or getattr(self.model, "replay_refusal", None)  # a decoder replays cannot run
        dry_reason, scored_dry = None, None
        scored_reason = None if self.scores is not None else "no step is scored"
        if reason is None:
            reason, dry_reason = self._check_sizes(scored=False)
            if reason is None and scored_reason is None:
                scored_reason, scored_dry = self._check_sizes(scored=True)
        self.clear()
        self.enabled, self.reason = reason is None, reason
        self.plans_dry, self.dry_reason = self.enabled and dry_reason is None, reason or dry_reason
        self.scored_reason = reason or scored_reason
        self._scored_dry = self.scored_reason is None and scored_dry is None
        if self.enabled and self.scores is not None:
            log.info(
                "CPU decode steps with attention scores (h2o eviction) %s",
                "replayed" if self.scored_reason is None else f"run eagerly: {self.scored_reason}",
            )
        if self.plans_dry:
            self.plan_ahead(range(1, min(self.inputs.max_batch, PLAN_AHEAD) + 1))
        if reason is None:
            log.info(
                "CPU decode steps replayed from C %s",
                "from their first runs, each size planned ahead"
                if self.plans_dry
                else f"after their first runs (not planned ahead: {dry_reason})",
            )
        else:
            log.info("CPU decode replays off, steps run eagerly: %s", reason)
        return reason

    def _check_sizes(self, scored: bool) -> tuple[Optional[str], Optional[str]]:
        """Record, replay and plan dry a step of one row and (where it records) of two, in the unscored or
        the scored form; returns (why that form cannot be replayed, why it cannot be planned dry), None each
        where it can."""
        dry_reason = None
        try:
            for bucket in (1, 2) if self.inputs.max_batch >= 2 and self._state_rows() >= 2 else (1,):
                self.inputs.fill_padding(bucket, self.inputs.max_blocks)
                self.inputs.scores = self.scores if scored else None
                self.stage(bucket)
                self._seed_states(bucket)
                eager = _copy(self.body(bucket))
                self._eager_states = self._stepped_states(bucket)
                self._eager_scores = self.scores.clone() if scored else None
                try:
                    _, plan = replay.record(lambda: self.body(bucket))
                except replay.Unreplayable:
                    if bucket == 1:
                        raise
                    break
                reason = self._check_plan(plan, eager, bucket)
                if reason is not None:
                    return reason, dry_reason
                dry_reason = dry_reason or self._check_dry(plan, eager, bucket)
        except replay.Unreplayable as exc:
            return str(exc), dry_reason
        finally:
            self._seed_states(2, zero=True)
            self.inputs.scores = None
        return None, dry_reason

    def _state_rows(self) -> int:
        return self.states.slots if self.states is not None else self.inputs.max_batch

    def _seed_states(self, bucket: int, zero: bool = False) -> None:
        """The state slots the self-check's padded rows step (``0..bucket-1``) set to the same random values
        before each run it compares (``zero``: back at rest, as the engine hands slots out), so an eager run,
        its recording and a replay each step the same states, and a replay reading another row's slot differs.
        A scored step's scores are zeroed (what each run adds is compared)."""
        if self.inputs.scores is not None:
            self.inputs.scores.zero_()
        if self.states is None:
            return
        self.inputs.state_slots[:bucket].copy_(torch.arange(min(bucket, self.inputs.max_batch)))
        gen = torch.Generator().manual_seed(0)
        for t in self.states.conv + self.states.recurrent:
            rows = t[: min(bucket, self.states.slots)]
            rows.zero_() if zero else rows.copy_(torch.randn(rows.shape, generator=gen) * 0.3)

    def _stepped_states(self, bucket: int) -> list[torch.Tensor]:
        """Copies of the states the self-check's padded rows stepped."""
        if self.states is None:
            return []
        rows = self.inputs.state_slots[:bucket]  # the slots the rows stepped (``_seed_states`` sets them)
        return [t.index_select(0, rows) for t in self.states.conv + self.states.recurrent]

    def _check_plan(
        self, plan: replay.Plan, eager: torch.Tensor, bucket: int, what: str = "replayed"
    ) -> Optional[str]:
        """None when ``plan`` replays to ``eager``'s bits, else why not."""
        # all-ones bytes (NaN in float32 and bf16): a replay that leaves its result unwritten fails
        arena = torch.full((plan.arena_bytes,), 0xFF, dtype=torch.uint8)
        self._seed_states(bucket)
        if not plan.replay(arena):
            return f"the {plan.refused} kernel refused its recorded arguments"
        if not _same(plan.output(arena), eager):
            return f"a {what} step of {bucket} rows differs from the eager one"
        if not all(map(torch.equal, self._stepped_states(bucket), self._eager_states)):
            return f"a {what} step of {bucket} rows leaves other linear-attention states than the eager one"
        if self.inputs.scores is not None and not torch.equal(self.inputs.scores, self._eager_scores):
            return f"a {what} step of {bucket} rows adds other attention scores than the eager one"
        return None

    def _check_dry(self, recorded: replay.Plan, eager: torch.Tensor, bucket: int) -> Optional[str]:
        """None when the step planned dry makes the recording's calls and replays to the eager bits."""
        try:
            _, plan = replay.record(lambda: self.body(bucket), dry=True)
        except replay.Unreplayable as exc:
            return f"a step of {bucket} rows planned dry: {exc}"
        if not plan.same_calls(recorded):
            return f"a step of {bucket} rows planned dry makes other calls than its recording"
        return self._check_plan(plan, eager, bucket, "planned")


def _copy(out):
    """A copy of a step's result: a tensor, or a tuple of tensors (a pipeline stage's stream)."""
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def _same(a, b) -> bool:
    """Whether two step results (tensors, or tuples of tensors) hold the same bits."""
    return len(a) == len(b) and all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)


def _spans(sizes: list[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    out, start = [], None
    for i, n in enumerate(sizes):
        if start is None:
            start = n
        if i + 1 == len(sizes) or sizes[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
