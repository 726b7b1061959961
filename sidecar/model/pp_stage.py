"""Pipeline-parallel stages of the decoder: which contiguous layers a stage holds, and the model it runs.

Of ``world`` stages over ``L`` decoder layers, stage ``s`` holds layers ``[s * L // world, (s + 1) * L // world)``
(the first ``L % world`` boundaries fall so that no two stages differ by more than one layer); the embedding
is used on stage 0 only, the final norm and the head on the last stage only. A stage's model is the whole
``CausalLM`` built on the meta device with every layer outside the stage replaced by ``nn.Identity`` before
the weights load (loader.py skips those), so each layer keeps its global index (its window, rope kind and
sparsity come from ``ModelArgs`` by that index) and no weight of another stage is read. Nor are the tables a
stage does not use: the embedding loads on stage 0 (and on the last stage where the head is tied to it), the
final norm and the head on the last stage only. Each stage's pool holds its own layers' caches at their shapes
(per-head K/V, or the latent of multi-head latent attention), and a hybrid model's stage the state slots of
its own linear-attention layers (engine/linear_state.py: every stage has rank 0's slot and checkpoint
counts).

Between stages travels the residual stream as the layers hand it on: ``h`` without the last layer's output
``delta`` added (the add is fused into the next norm), both ``[T, hidden]`` in the model dtype, so a split
model computes exactly what one process would.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from sidecar.model.args import ModelArgs

OPTION = "pipeline_parallel_size"


def stage_layers(num_layers: int, world: int, stage: int) -> range:
    """The global indices of the decoder layers stage ``stage`` of ``world`` holds."""
    return range(stage * num_layers // world, (stage + 1) * num_layers // world)


@dataclasses.dataclass
class Stage:
    """Stage ``rank`` of ``world``: passed to ``load_model`` as its ``shard``."""

    rank: int
    world: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def check(self, args: ModelArgs) -> None:
        """Raises ValueError naming ``pipeline_parallel_size`` where this model cannot be split in stages."""
        problems = []
        if args.num_layers < self.world:
            problems.append(f"{args.num_layers} layers for {self.world} stages")
        if getattr(args, "decoder_module", None):
            problems.append("a decoder of its own (per-layer inputs, layers sharing another's KV)")
        if problems:
            raise ValueError(
                f"{OPTION}: {args.architecture} cannot be split in {self.world} stages: "
                + ", ".join(problems)
            )

    def layers(self, args: ModelArgs) -> range:
        return stage_layers(args.num_layers, self.world, self.rank)

    def kv_shapes(self, args: ModelArgs) -> list[tuple[int, int]]:
        """(KV heads, head size) of each of this stage's layers, in layer order: the caches its pool holds."""
        return args.kv_shapes(self.layers(args))

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The model is built whole (on the meta device), so each layer keeps its global index."""
        self.check(args)
        return args

    def checkpoint(self, ckpt, args: ModelArgs):
        return ckpt

    def prune(self, model: nn.Module) -> None:
        """Replace every layer outside this stage by ``nn.Identity`` (before any weight loads)."""
        keep = self.layers(model.args)
        model.stage_ends = (self.first, self.last)  # the loader reads the embedding and head where used
        for i in range(len(model.layers)):
            if i not in keep:
                model.layers[i] = nn.Identity()

    def wrap(self, model: nn.Module, args: ModelArgs) -> None:
        """Drop the tables this stage does not use and did not load (the head keeps a tied table through its
        own reference)."""
        if not self.first:
            model.embed_tokens = None
        if not self.last:
            model.norm = None
            model.lm_head = None


def stage_args(args: ModelArgs, stage: Stage) -> ModelArgs:
    """The args a stage's caches are allocated from: its own layers, numbered from 0 in layer order, with a
    hybrid model's linear-attention layers among them renumbered alike (``ModelArgs.kv_shapes`` then lists
    the stage's attention layers, ``linear_layers`` the stage's state-slot layers)."""
    keep = stage.layers(args)
    linear = tuple(i - keep.start for i in args.linear_layers if i in keep)
    return dataclasses.replace(args, num_layers=len(keep), linear_layers=linear)


def run_layers(
    model: nn.Module,
    stage: Stage,
    h: torch.Tensor,
    delta: Optional[torch.Tensor],
    positions: torch.Tensor,
    kv_caches: list,
    meta,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's layers over the stream ``(h, delta)`` (stage 0: ``h`` the embedded tokens, ``delta`` None),
    each layer reading its own cache in ``kv_caches`` (this stage's pool, in layer order: a KV cache, or a
    linear-attention layer's state slots)."""
    from sidecar.model.attention import sdpa_backends

    cos, sin = model.rope_rows(positions)
    meta.positions = positions
    layers = [model.layers[i] for i in stage.layers(model.args)]
    with sdpa_backends(h.device):
        for layer, kv in zip(layers, kv_caches):
            h, delta = layer(h, delta, cos, sin, kv, meta)
    return h, delta


def final_logits(model: nn.Module, h: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The last stage's float32 logits of rows ``rows`` of the stream: the final norm, then the head."""
    return model.compute_logits(model.norm(h, delta)[0].index_select(0, rows))
