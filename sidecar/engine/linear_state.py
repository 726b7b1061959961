"""Linear-attention state slots of hybrid models (Qwen3.5: gated DeltaNet layers among attention layers).

A linear-attention layer keeps no keys and values: each sequence carries a fixed-size state instead
(model/deltanet.py: the convolution's last inputs and the recurrent matrix). The pool holds ``slots`` such
states for every linear layer; slot ``s`` of every layer belongs to one sequence at a time. The
KVCacheManager hands a slot out when a sequence is first scheduled (zeroed here) and takes it back
whenever its KV blocks go back (finish, failure, abort, preemption: a preempted sequence rebuilds its state
by recomputing its prompt); the scheduler cannot run a sequence without one. Attention layers keep the
paged KV cache, so the KV pool is sized over those layers alone.

Row ``slots`` (``LinearStates.scratch``) belongs to no sequence: a decode batch padded up to a bucket
(input_buffers.py) points every padded row at it, so padded rows -- in captured decode graphs, whose rows are
whatever the buffers name at replay -- step a state nothing reads and never a sequence's. Several padded
rows step it at once; what it holds is never read for a real row.

Prefix caching stays exact through checkpoints (``StateCheckpoints``): when a step leaves a sequence's
computed tokens exactly on a full block's end, the state in its slot is the state after that block's prefix,
and a copy of it is kept under that block's hash. A prefix hit is served only up to the last hit block that
has a checkpoint (whose copy then becomes the new sequence's state), so a state is only ever restored from
the exact prefix it was computed over, never approximated. Checkpoints sit in rows past the scratch row of
the same tensors (a separate budget: as many checkpoints as slots, the same bytes again), least recently
used evicted first.

Layouts, per linear layer: conv ``[slots, conv_dim, kernel - 1]`` in the model dtype (the inputs HF's
convolution state holds), recurrent ``[slots, v_heads, k_dim, v_dim]`` float32 (HF's recurrent state is
float32 whatever the model dtype).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Optional

import torch

from sidecar.model.args import ModelArgs

log = logging.getLogger("sidecar.engine")

# Why speculative decoding steps aside for these models (logged once): the start-up self-check, decode
# graphs and replays carry the state slots, a rejected proposal's rollback does not.
STATEFUL_REASON = "linear-attention layers keep a per-sequence state that speculative rollback does not carry"
OFFLOAD_REASON = (
    "linear-attention layers restore a prefix hit's state from a checkpoint the offload tiers do not keep"
)


def plan_slots(args: ModelArgs, dtype: torch.dtype, max_num_seqs: int, kv_bytes: int) -> int:
    """How many state slots: one per running sequence (``max_num_seqs``), but the states never take more
    memory than the KV pool itself, and at least one slot (a sequence beyond the slots waits for one)."""
    conv, rec = args.linear.state_elements()
    per_seq = len(args.linear_layers) * (conv * dtype.itemsize + rec * 4)
    return max(1, min(max_num_seqs, kv_bytes // per_seq))


class LinearStates:
    def __init__(
        self, args: ModelArgs, slots: int, dtype: torch.dtype, device: torch.device, checkpoints: int = 0
    ) -> None:
        """``slots`` state slots (rows ``0..slots-1``), the scratch row ``slots`` and ``checkpoints``
        prefix-cache checkpoints (the rows after it) of every linear layer."""
        spec = args.linear
        self.slots = slots
        self.scratch = slots  # padded decode rows step this row (module docstring)
        self.checkpoints = checkpoints
        self.layers = args.linear_layers
        rows = slots + 1 + checkpoints
        self.conv = [
            torch.zeros(rows, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
            for _ in self.layers
        ]
        self.recurrent = [
            torch.zeros(rows, spec.num_v_heads, spec.k_dim, spec.v_dim, dtype=torch.float32, device=device)
            for _ in self.layers
        ]
        # Called with ("reset", slot) or ("copy", src, dst) after each such change here: a pipeline stage's
        # states follow rank 0's (engine/pp.py), whose scheduler alone decides the slots.
        self.mirror: Optional[Callable[..., None]] = None
        per_row = sum(t[0].numel() * t.element_size() for t in self.conv + self.recurrent)
        self.bytes = per_row * slots
        self.checkpoint_bytes = per_row * checkpoints
        log.info(
            "linear-attention state: %d layers x %d slots + %d checkpoints + 1 scratch row, %.1f KiB a "
            "sequence (%.1f MiB)",
            len(self.layers),
            slots,
            checkpoints,
            per_row / 2**10,
            (self.bytes + self.checkpoint_bytes + per_row) / 2**20,
        )

    def layer_caches(self, args: ModelArgs, kv_caches: list) -> list:
        """What each decoder layer's mixer reads: its (conv, recurrent) state for a linear layer, its KV cache
        (``kv_caches``: one per attention layer, in order) otherwise."""
        states = iter(zip(self.conv, self.recurrent))
        kvs = iter(kv_caches)
        return [next(states) if args.is_linear(i) else next(kvs) for i in range(args.num_layers)]

    def rows(self, rows: list[int]) -> list[torch.Tensor]:
        """Copies of these rows of every conv and recurrent tensor (what ``put_rows`` puts back)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.conv[0].device)
        return [t.index_select(0, idx) for t in self.conv + self.recurrent]

    def put_rows(self, rows: list[int], saved: list[torch.Tensor]) -> None:
        """These rows of every tensor set back to ``rows``' copies ``saved``."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.conv[0].device)
        for t, old in zip(self.conv + self.recurrent, saved):
            t.index_copy_(0, idx, old)

    def reset(self, slot: int) -> None:
        """A slot handed to a sequence that starts from rest."""
        for t in self.conv + self.recurrent:
            t[slot].zero_()
        if self.mirror is not None:
            self.mirror("reset", slot)

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of ``src`` (a forked beam continues its parent's state)."""
        for t in self.conv + self.recurrent:
            t[dst].copy_(t[src])
        if self.mirror is not None:
            self.mirror("copy", src, dst)

    def info(self) -> dict:
        """The state group's figures for ``/v1/models`` and the start-up log."""
        return {
            "linear_attention_layers": len(self.layers),
            "linear_state_slots": self.slots,
            "linear_state_bytes_per_sequence": self.bytes // max(1, self.slots),
            "linear_state_bytes": self.bytes,
            "linear_state_checkpoints": self.checkpoints,
            "linear_state_checkpoint_bytes": self.checkpoint_bytes,
        }


def cache_groups(
    attention_layers: int,
    kv_bytes: int,
    kv_tokens: int,
    states: Optional[LinearStates],
    kind: str = "attention",
) -> list[dict]:
    """The model's cache groups as ``/v1/models`` lists them: the paged KV of its attention layers (``kind``
    "latent_attention" where they cache latents, model/mla.py), and a hybrid model's linear-attention state
    slots."""
    groups = [{"kind": kind, "layers": attention_layers, "bytes": kv_bytes, "tokens": kv_tokens}]
    if states is not None:
        groups.append(
            {
                "kind": "linear_attention",
                "layers": len(states.layers),
                "bytes": states.bytes,
                "slots": states.slots,
                "bytes_per_sequence": states.bytes // max(1, states.slots),
                "checkpoints": states.checkpoints,
                "checkpoint_bytes": states.checkpoint_bytes,
            }
        )
    return groups


def groups_of(runner) -> list[dict]:
    """``cache_groups`` of a ``ModelRunner``: its KV pool (of latents for multi-head latent attention) and
    its state slots."""
    kind = "latent_attention" if runner.model.args.latent is not None else "attention"
    tokens = (runner.num_blocks - 1) * runner.block_size
    plan = runner.kv_plan
    if plan is not None:  # KV groups (kv_groups.py): one pool of pages, each page one group's layers
        page = runner.kv_cache_bytes // runner.num_blocks
        return [
            {
                "kind": {"full": "attention"}.get(g.kind, f"{g.kind}_attention"),
                "layers": len(g.layers),
                **({} if g.span is None else {"window" if g.kind == "sliding" else "chunk": g.span}),
                # layers attending on this group's caches without their own (KV sharing), and the caches'
                # shape where the groups' differ
                **({"shared_layers": len(g.readers)} if g.readers else {}),
                **({"kv_heads": g.shape[0], "head_dim": g.shape[1]} if len(plan.shapes) > 1 else {}),
                "block_bytes": page,
                "pool_bytes": runner.kv_cache_bytes,
                "pool_blocks": runner.num_blocks - 1,
                # a sliding / chunked group's pages per decoding sequence; None: one per block of it
                "max_blocks_per_sequence": g.max_blocks(runner.block_size, 1),
            }
            for g in plan.groups
        ]
    return cache_groups(len(runner.kv_caches), runner.kv_cache_bytes, tokens, runner.states, kind)


class SlotPool:
    """Free state slots and the slot each sequence holds (request id -> slot). ``reset`` / ``copy`` are the
    runner's ``LinearStates`` methods."""

    def __init__(self, states: LinearStates) -> None:
        self.states = states
        self.free = list(range(states.slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.held: dict[str, int] = {}

    def take(self, request_id: str) -> bool:
        """Give ``request_id`` a zeroed slot unless it holds one; False when none is free."""
        if request_id in self.held:
            return True
        if not self.free:
            return False
        slot = self.held[request_id] = self.free.pop()
        self.states.reset(slot)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` gets a slot holding a copy of ``parent_id``'s state."""
        if not self.free:
            raise RuntimeError("no free linear-attention state slot for a forked beam (max_num_seqs)")
        slot = self.held[child_id] = self.free.pop()
        self.states.copy(self.held[parent_id], slot)

    def give_back(self, request_id: str) -> None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def slot(self, request_id: str) -> int:
        return self.held[request_id]

    def whole(self) -> bool:
        """Every slot free and held by no one (the accounting after all requests ended)."""
        return not self.held and sorted(self.free) == list(range(self.states.slots))


class StateCheckpoints:
    """The states after cached prefixes, by the hash of the prefix's last block: rows ``slots + 1 ..
    slots + checkpoints`` of the ``LinearStates`` tensors (past the scratch row), least recently saved or
    restored evicted first. A checkpoint is keyed by a chained block hash, which covers every token of the
    prefix (and the cache salt), so it stays valid whatever happens to the KV block that carried the hash."""

    def __init__(self, states: LinearStates) -> None:
        self.states = states
        first = states.scratch + 1
        self.free = list(range(first + states.checkpoints - 1, first - 1, -1))
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self.saved = self.restored = self.evicted = 0

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.rows

    def save(self, block_hash: bytes, slot: int) -> None:
        """Keep slot ``slot``'s state (the state right after the block ``block_hash`` ends)."""
        if block_hash in self.rows:
            self.rows.move_to_end(block_hash)  # the same prefix gives the same state
            return
        if not self.free:
            if not self.rows:
                return  # no checkpoint rows at all
            _, row = self.rows.popitem(last=False)
            self.free.append(row)
            self.evicted += 1
        row = self.rows[block_hash] = self.free.pop()
        self.states.copy(slot, row)
        self.saved += 1

    def restore(self, block_hash: bytes, slot: int) -> None:
        """Slot ``slot`` becomes the state after the block ``block_hash`` (which must have a checkpoint)."""
        row = self.rows[block_hash]
        self.rows.move_to_end(block_hash)
        self.states.copy(row, slot)
        self.restored += 1

    def stats(self) -> dict:
        return {
            "state_checkpoints": len(self.rows),
            "state_checkpoints_saved": self.saved,
            "state_checkpoints_restored": self.restored,
            "state_checkpoints_evicted": self.evicted,
        }

    def whole(self) -> bool:
        """Every checkpoint row either free or holding one prefix's state."""
        rows = sorted(self.free + list(self.rows.values()))
        first = self.states.scratch + 1
        return rows == list(range(first, first + self.states.checkpoints))
