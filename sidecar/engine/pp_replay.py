"""CPU decode replays of one pipeline stage: ``cpu_graphs.py``'s recorded plans over a stage's own layers.

A stage's forward holds no collective (the stages hand the residual stream on between forwards, pp.py), so a
stage replays its share of a pure-decode step from C as a whole model replays its step. What a plan reads
stays at fixed addresses: every stage keeps its own persistent decode inputs (``DecodeInputs``: positions, KV
slots, context lengths, block tables ``max_blocks`` wide, a hybrid model's state slots), into which each
micro-batch is copied before it runs (``load``: a micro-batch is a decode batch of its own size, its rows
from row 0), and its own staged rows: stage 0 embeds the token ids into them, a later stage copies the
stream it received (``h``, ``delta``) into them. The plan runs the stage's layers over those rows and its
result is the stream it hands on (``h``, ``delta``: a tuple result, two tensors in the plan's arena, read
before the next part replays). The last stage's final norm and head run eagerly over the rows sampled
(pp.py's ``final_logits``), as for an eager step.

The parts that replay are plain decode batches: no prompt rows, one table per row, no per-layer KV groups, no
attention scores (a scored step runs whole, eagerly), no adapter rows (a step with them runs whole,
eagerly). Anything else runs eagerly through ``run_layers`` as before.

Every stage checks its own replay at start (``CpuDecodePlans.self_check``: a later stage's staged rows hold
seeded random values for it) and the stages then agree: where any stage's check fails, every stage runs
eagerly, each logging the failing stage's reason (``PipelineParallel.check_replays``).
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.engine.cpu_graphs import CpuDecodePlans
from sidecar.engine.input_buffers import DecodeInputs, decode_metadata

# the stream a later stage's self-check runs over (seeded, so every check of a stage reads the same rows)
SEED = 7


class StagePlans(CpuDecodePlans):
    """The decode replays of pipeline stage ``stage`` (``pp_stage.Stage``) of ``model`` (the whole model built
    with the other stages' layers as ``nn.Identity``): ``kv_caches`` what each of its layers reads (its KV
    cache or its state slots, in layer order), ``states`` its ``LinearStates`` (None: no linear layers)."""

    def __init__(
        self,
        model,
        stage,
        kv_caches: list,
        states,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        slots = states.slots if states is not None else 0
        inputs = DecodeInputs(max_batch, max_blocks, block_size, torch.device("cpu"), None, slots)
        super().__init__(model, kv_caches, inputs, states, None)
        self.pp_stage, self.dtype = stage, dtype
        self._layers = [model.layers[i] for i in stage.layers(model.args)]
        self._delta: Optional[torch.Tensor] = None

    def _allocate(self) -> None:
        m, size, cos = self.inputs.max_batch, self.model.args.hidden_size, self.model.rope_cos
        gen = torch.Generator().manual_seed(SEED)
        self.clear()  # plans hold these buffers' addresses
        self._hidden = (torch.randn(m, size, generator=gen) * 0.5).to(self.dtype)
        if not self.pp_stage.first:
            self._delta = (torch.randn(m, size, generator=gen) * 0.5).to(self.dtype)
        self._rope = (
            torch.empty(cos.shape[0], m, 1, cos.shape[-1], dtype=cos.dtype),
            torch.empty(cos.shape[0], m, 1, cos.shape[-1], dtype=cos.dtype),
        )

    def stage(self, bucket: int) -> None:
        """The rows outside the stage's layers: stage 0 embeds the buffers' token ids, a later stage's rows
        are the stream ``load`` copied in; the rope rows of the buffers' positions."""
        if self._hidden is None:
            self._allocate()
        if self.pp_stage.first:
            self._hidden[:bucket].copy_(self.model.embed(self.inputs.ids[:bucket]))
        self.model.rope_rows(self.inputs.positions[:bucket], out=self._rope)

    def body(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers over the staged rows, eagerly: the step a plan records. Returns the stream
        ``(h, delta)`` handed to the next stage (the last stage's final norm runs outside)."""
        from sidecar.model.attention import sdpa_backends

        cos, sin = self._rope
        cos, sin = cos[:, :bucket], sin[:, :bucket]
        meta = decode_metadata(self.inputs, bucket)
        h = self._hidden[:bucket]
        delta = None if self.pp_stage.first else self._delta[:bucket]
        with sdpa_backends(h.device):
            for layer, kv in zip(self._layers, self.kv_caches):
                h, delta = layer(h, delta, cos, sin, kv, meta)
        return h, delta

    def replays(self) -> bool:
        paths = getattr(self.model, "fast_paths", None)
        return self.enabled and not (paths is not None and paths.active())

    def load(self, ids, positions, meta, stream=None) -> Optional[int]:
        """Copy one micro-batch into the buffers (rows from 0; ``ids`` are read on stage 0, ``stream``, the
        received ``(h, delta)``, on a later stage); returns its row count, or None (nothing copied) where it is
        not a plain decode batch that fits the buffers."""
        n, tables, inputs = positions.shape[0], meta.decode_block_tables, self.inputs
        if (
            meta.prefills
            or tables is None
            or tables.shape[0] != n
            or not 1 <= n <= inputs.max_batch
            or tables.shape[1] > inputs.max_blocks
            or meta.layer_metas is not None
            or meta.kv_scores is not None
            or (inputs.state_rows and meta.decode_state_slots is None)
        ):
            return None
        if self._hidden is None:
            self._allocate()
        if self.pp_stage.first:
            inputs.ids[:n].copy_(ids)
        else:
            self._hidden[:n].copy_(stream[0])
            self._delta[:n].copy_(stream[1])
        inputs.positions[:n].copy_(positions)
        inputs.slots[:n].copy_(meta.slot_mapping)
        inputs.ctx_lens[:n].copy_(meta.decode_ctx_lens)
        if inputs.state_rows:
            inputs.state_slots[:n].copy_(meta.decode_state_slots)
        # a plan's tables are max_blocks wide; the attention kernel reads only a row's own context's columns
        wide, w = inputs.tables(n, inputs.max_blocks), tables.shape[1]
        wide[:, :w].copy_(tables)
        wide[:, w:].zero_()
        inputs.bucket, inputs.width, inputs.scores = n, inputs.max_blocks, None
        return n

    def run_part(self, ids, positions, meta, stream=None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The stream ``(h, delta)`` of one micro-batch through the stage's layers, replayed (or run over the
        buffers where its size has no plan yet); None where replays are off or the part is not a plain decode
        batch (the caller runs it eagerly). The result may live in the arena: read it before the next part."""
        if not self.replays():
            return None
        n = self.load(ids, positions, meta, stream)
        return None if n is None else self.run(n)
