"""Tensor-parallel sharding of the decoder: which slice of each checkpoint tensor a rank holds, and the
modules that join the slices back with one collective each.

Of ``world`` ranks, rank ``r`` holds:

- attention: query heads ``[r * H / world, (r + 1) * H / world)`` and the KV heads they read -- a contiguous
  ``1 / world`` of the KV heads when there are at least as many as ranks, else the one KV head its query heads
  share (replicated on ``world / KV`` ranks); q/k/v rows (and biases) of those heads (column-parallel), the
  matching columns of o_proj (row-parallel);
- MLP: ``1 / world`` of the intermediate rows of gate/up (column-parallel), those columns of down_proj
  (row-parallel);
- mixture of experts: every expert's ``1 / world`` of its intermediate rows (gate/up rows, down columns: each
  checkpoint layout sliced as ``_expert_slice`` reads it), the shared expert's likewise, the router (and a
  shared expert's one-output gate) whole; so every rank routes every token alike, weighs its partial expert
  outputs by the same weights, and the block's output (routed sum plus shared expert) is summed by one
  all-reduce per layer (an expert's down bias on rank 0 only); attention sinks: the query heads' own;
- embedding and head: vocabulary rows ``[r * V', (r + 1) * V')`` with ``V' = ceil(V / world)``, the last
  rank's table padded with zero rows.

A row-parallel layer's partial products are summed by one all-reduce (its bias on rank 0 only, so it is
added once); the embedding looks up the ids its rows hold (zeros elsewhere) and all-reduces; the head's
float32 logits are all-gathered along the vocabulary and the padding cut, so every rank holds the whole
logits row (the sampler on rank 0 sees exactly what one process would compute, up to summation order).

Weight quantization on load (loader.py) quantizes each rank's slices: int4 groups along the input columns that
do not straddle a row-parallel split give one process's codes; int8's per-row scales of o / down cover one
rank's columns.

Collectives run on a ``Comm``: a torch.distributed process group of this model's ranks alone (gloo on CPU
tensors, NCCL on CUDA ones), not the global default group, with the group's timeout on every call. Where every
rank is on one host's CPUs, a float32 / bf16 all-reduce goes through the group's shared-memory segment instead
(``Comm.shm``, set on every rank or none: engine/tp_shm.py), summed in rank order so every rank gets the same
bits; its waits end with an error when a peer exits or the timeout runs out. Rank 0's
``Comm`` waits in slices of ``WAIT_SLICE_S`` and asks its ``alive`` check between them: a peer whose host
vanished (no exit, its connections open and silent) never fails the collective before the group's timeout,
but the heartbeat watchdog ends it within seconds, and the wait then ends with the check's error.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model.kernels.cpu import cpu_build


WAIT_SLICE_S = 0.25  # how often a waiting rank 0 asks whether its peers are still there


class Comm:
    """The collectives a sharded model runs, over one ``torch.distributed`` ProcessGroup. ``alive`` (rank 0's:
    raises once a peer is lost) is called between slices of every wait; without it a wait is one call."""

    def __init__(self, group: Any, rank: int, world: int, alive: Optional[Callable[[], None]] = None) -> None:
        self.group, self.rank, self.world, self.alive = group, rank, world, alive
        self.shm: Optional[Any] = None  # the group's ShmAllReduce (kernels/cpu/shm_allreduce.py), when in use
        self.shm_calls = 0  # all-reduces routed to it (a replay's calls from C not counted)

    def wait(self, work: Any, point_to_point: bool = False) -> None:
        """Wait until ``work`` (an operation of the group) completes; its error is raised, or ``alive``'s while
        it is still pending. Gloo ends a point-to-point operation whose timed wait runs out (it closes the
        pair), so such a wait runs untimed on a thread of its own while this one waits in slices."""
        if self.alive is None:
            work.wait()
            return
        if point_to_point:
            done, failed = threading.Event(), []
            threading.Thread(target=_wait_into, args=(work, done, failed), daemon=True).start()
            while not done.wait(WAIT_SLICE_S):
                self.alive()
            if failed:
                raise failed[0]
            return
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:  # the slice ran out, or the operation failed
                if work.is_completed():
                    work.wait()  # its own outcome: done, or the operation's error
                    return
                self.alive()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous) over the ranks, in place; returns it. Every rank takes the same path for
        the same call (it depends on the dtype and layout alone, alike on every rank)."""
        if self.shm is not None and self.shm.supports(t):
            self.shm_calls += 1
            return self.shm(t)
        if getattr(cpu_build._recording, "recorder", None) is not None:  # a step recorded for replay
            from sidecar.model.kernels.cpu.replay import Unreplayable

            raise Unreplayable("a gloo all-reduce (no kernel call: a replay would skip it)")
        self.wait(self.group.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.wait(self.group.allgather([parts], [t.contiguous()]))
        return parts


_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)


def _wait_into(work: Any, done: threading.Event, failed: list) -> None:
    try:
        work.wait()
    except Exception as exc:  # raised in the waiting thread
        failed.append(exc)
    finally:
        done.set()


@dataclasses.dataclass
class Shard:
    """Rank ``rank`` of ``world`` and the collectives joining its slices (None: only slicing, no forward)."""

    rank: int
    world: int
    comm: Optional[Comm] = None

    def check(self, args: ModelArgs) -> None:
        """Raises ValueError naming ``tensor_parallel_size`` where this model cannot be split ``world`` ways."""
        n, nh, nkv = self.world, args.num_heads, args.num_kv_heads
        problems = []
        if nh % n:
            problems.append(f"{nh} attention heads")
        if (nkv % n) if nkv >= n else (n % nkv):
            problems.append(f"{nkv} KV heads (a multiple or a divisor of the ranks)")
        if args.intermediate_size % n:
            problems.append(f"intermediate size {args.intermediate_size}")
        for what, size in (
            ("expert", args.expert_intermediate_size),
            ("shared expert", args.shared_expert_size),
        ):
            if size % n:
                problems.append(f"{what} intermediate size {size}")
        if args.routing is not None:
            problems.append("group-limited routing")
        if args.fused_checkpoint:
            problems.append("checkpoint-fused qkv / gate_up projections")
        if args.linear_layers or args.attn_output_gate:
            problems.append("linear-attention layers or gated attention output")
        if args.layer_head_dims or args.kv_source:
            problems.append("layers of different head sizes or shared KV")
        if args.latent is not None:
            problems.append("multi-head latent attention layers")
        if problems:
            raise ValueError(
                f"tensor_parallel_size: {args.architecture} cannot be split over {n} ranks: "
                + ", ".join(problems)
            )

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The args this rank's decoder is built with: its heads, intermediate rows and vocabulary rows."""
        self.check(args)
        n = self.world
        return dataclasses.replace(
            args,
            num_heads=args.num_heads // n,
            num_kv_heads=max(1, args.num_kv_heads // n),
            intermediate_size=args.intermediate_size // n,
            expert_intermediate_size=args.expert_intermediate_size // n,
            shared_expert_size=args.shared_expert_size // n,
            vocab_size=-(-args.vocab_size // n),
        )

    def ranges(self, args: ModelArgs) -> dict[str, tuple[int, int]]:
        """Row ranges this rank holds: query heads, KV heads, intermediate rows (dense, expert and shared
        expert), vocabulary rows."""
        r, n = self.rank, self.world
        nh, nkv, v = args.num_heads, args.num_kv_heads, args.vocab_size
        q = (r * nh // n, (r + 1) * nh // n)
        kv = (r * nkv // n, (r + 1) * nkv // n) if nkv >= n else (r * nkv // n, r * nkv // n + 1)
        rows = -(-v // n)
        part = lambda size: (r * size // n, (r + 1) * size // n)  # noqa: E731
        return {
            "q": q,
            "kv": kv,
            "mlp": part(args.intermediate_size),
            "expert": part(args.expert_intermediate_size),
            "shared": part(args.shared_expert_size),
            "vocab": (r * rows, rows),
        }

    def lora_slice(
        self, args: ModelArgs, module: str, A: torch.Tensor, B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair (A [r, in], B [out, r]) on PEFT module ``module``, split as its
        weight is: a column-parallel module's B keeps this rank's output rows (A whole), a row-parallel
        module's A keeps this rank's input columns (B whole: each rank's ``B (A_r x_r)`` is a partial sum
        that the layer's all-reduce adds up, so the update counts once)."""
        r, hd = self.ranges(args), args.head_dim
        rows = {"q_proj": r["q"], "k_proj": r["kv"], "v_proj": r["kv"]}
        if module in rows:
            lo, hi = rows[module]
            return A, B[lo * hd : hi * hd].contiguous()
        if module in ("gate_proj", "up_proj"):
            return A, B[r["mlp"][0] : r["mlp"][1]].contiguous()
        lo, hi = (r["q"][0] * hd, r["q"][1] * hd) if module == "o_proj" else r["mlp"]
        return A[:, lo:hi].contiguous(), B

    def checkpoint(self, ckpt: Any, args: ModelArgs) -> "ShardedCheckpoint":
        return ShardedCheckpoint(ckpt, self, args)

    def wrap(self, model: nn.Module, args: ModelArgs) -> None:
        """Join the loaded slices of ``model`` (built from ``local_args``): all-reduce after o_proj and
        down_proj (after a sparse layer's whole block), the embedding's lookup and the head's gather over the
        vocabulary."""
        if self.comm is None:  # slices only, to read (a forward of them would give partial sums)
            return
        lo, rows = self.ranges(args)["vocab"]
        for i, layer in enumerate(model.layers):
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, self.comm)
            if args.sparse(i):
                layer.mlp = RowParallel(layer.mlp, self.comm)
            else:
                layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, self.comm)
        model.lora_slice = functools.partial(self.lora_slice, args)  # adapters load sliced (lora.py)
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, lo, rows, self.comm)
        model.lm_head = VocabParallelHead(model.lm_head, args.vocab_size, self.comm)


class ShardedCheckpoint:
    """A checkpoint as one rank sees it: ``get`` returns this rank's slice of a tensor (see the module
    docstring); names the split does not touch (norms) come whole."""

    def __init__(self, ckpt: Any, shard: Shard, args: ModelArgs) -> None:
        self.ckpt, self.shard, self.args = ckpt, shard, args
        self.r = shard.ranges(args)

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        t = self.ckpt.get(name)
        hd, r = self.args.head_dim, self.r
        if ".experts." in name or ".shared_expert." in name:
            return self._expert_slice(name, t)
        part = name.rsplit(".", 2)
        module, kind = (part[-2], part[-1]) if len(part) == 3 else ("", part[-1])
        if kind == "sinks":  # one logit per query head
            return t[r["q"][0] : r["q"][1]].contiguous()
        if module == "q_proj":
            return t[r["q"][0] * hd : r["q"][1] * hd].contiguous()
        if module in ("k_proj", "v_proj"):
            return t[r["kv"][0] * hd : r["kv"][1] * hd].contiguous()
        if module in ("gate_proj", "up_proj"):
            return t[r["mlp"][0] : r["mlp"][1]].contiguous()
        if module in ("o_proj", "down_proj"):
            if kind == "bias":  # added once, after the sum
                return t if self.shard.rank == 0 else torch.zeros_like(t)
            lo, hi = (r["q"][0] * hd, r["q"][1] * hd) if module == "o_proj" else r["mlp"]
            return t[:, lo:hi].contiguous()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo, rows = r["vocab"]
            out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
            piece = t[lo : lo + rows]
            out[: piece.shape[0]] = piece
            return out
        return t

    def _expert_slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of an expert tensor, in each layout ``moe.expert_weights`` reads: per-expert
        ``experts.<e>.<gate|up|down>.weight`` (and a shared expert's ``<gate|up|down>_proj``); fused
        ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``experts.down_proj`` [E, H, I]; gpt-oss's
        ``gate_up_proj`` [E, H, 2I] with gate / up columns interleaved (pair ``j`` at ``2j, 2j + 1``: a rank's
        pairs are contiguous), ``down_proj`` [E, I, H], their biases, and MXFP4 ``*_blocks`` / ``*_scales``
        (outputs first; the down projection's inputs in blocks of 32, so its split must fall on one)."""
        shared = ".shared_expert." in name
        lo, hi = self.r["shared" if shared else "expert"]
        width = self.args.shared_expert_size if shared else self.args.expert_intermediate_size
        tail = name.rsplit(".shared_expert." if shared else ".experts.", 1)[-1]
        interleaved = self.args.expert_bias  # gpt-oss's fused layout
        if tail == "gate_up_proj":
            if interleaved:
                return t[:, :, 2 * lo : 2 * hi].contiguous()
            return torch.cat((t[:, lo:hi], t[:, width + lo : width + hi]), 1)
        if tail == "down_proj":
            return (t[:, lo:hi] if interleaved else t[:, :, lo:hi]).contiguous()
        if tail in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
            return t[:, 2 * lo : 2 * hi].contiguous()
        if tail == "down_proj_bias":  # added once, after the sum
            return t if self.shard.rank == 0 else torch.zeros_like(t)
        if tail in ("down_proj_blocks", "down_proj_scales"):
            if lo % 32 or hi % 32:
                raise ValueError(
                    f"tensor_parallel_size: {self.shard.world} ranks split the MXFP4 experts' "
                    f"{width} intermediate columns off their 32-column blocks"
                )
            return t[:, :, lo // 32 : hi // 32].contiguous()
        _, gate, up, down = self.args.moe_names
        module = tail.split(".")[-2] if tail.endswith(".weight") and "." in tail else None
        if module in (gate, up, "gate_proj", "up_proj"):  # per expert (or shared): [I, H]
            return t[lo:hi].contiguous()
        if module in (down, "down_proj"):  # [H, I]
            return t[:, lo:hi].contiguous()
        raise ValueError(f"tensor_parallel_size: expert tensor {name!r} has no known split")


class RowParallel(nn.Module):
    """A row-parallel linear layer: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Lookups of the ids in this rank's vocabulary rows ``[lo, lo + rows)``; zeros for the others; summed over
    the ranks, so each id's row comes from the one rank holding it (exact: the other terms are zeros)."""

    def __init__(self, inner: nn.Module, lo: int, rows: int, comm: Comm) -> None:
        super().__init__()
        self.inner, self.lo, self.rows, self.comm = inner, lo, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.rows)
        out = self.inner(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out.contiguous())


class VocabParallelHead(nn.Module):
    """The head over this rank's vocabulary rows; float32 logits gathered from every rank along the vocabulary,
    the padding rows cut: ``[N, vocab_size]`` on every rank."""

    def __init__(self, inner: nn.Module, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.comm = inner, vocab_size, comm

    def float_forward(self, x: torch.Tensor) -> torch.Tensor:
        widened = getattr(self.inner, "float_forward", None)
        local = widened(x) if widened is not None else None
        local = local if local is not None else self.inner(x).float()
        return torch.cat(self.comm.all_gather(local), dim=-1)[..., : self.vocab_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.float_forward(x)
