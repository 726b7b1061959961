"""Linear-attention state slots of hybrid models (Qwen3.5: gated DeltaNet layers among attention layers).

A linear-attention layer keeps no keys and values: each sequence carries a fixed-size state instead
(model/deltanet.py: the convolution's last inputs and the recurrent matrix). The pool holds ``slots`` such
states for every linear layer; slot ``s`` of every layer belongs to one sequence at a time. The
KVCacheManager hands a slot out when a sequence is first scheduled (zeroed here) and takes it back
whenever its KV blocks go back (finish, failure, abort, preemption: a preempted sequence rebuilds its state
by recomputing its prompt); the scheduler cannot run a sequence without one. Attention layers keep the
paged KV cache, so the KV pool is sized over those layers alone.

Layouts, per linear layer: conv ``[slots, conv_dim, kernel - 1]`` in the model dtype (the inputs HF's
convolution state holds), recurrent ``[slots, v_heads, k_dim, v_dim]`` float32 (HF's recurrent state is
float32 whatever the model dtype).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sidecar.model.args import ModelArgs

log = logging.getLogger("sidecar.engine")

# Why the paths that cannot carry a per-sequence state step aside for these models (each logged once).
STATEFUL_REASON = (
    "linear-attention layers keep a per-sequence state that the start-up self-check, decode graphs, "
    "replays and speculative rollback do not carry"
)
PREFIX_CACHE_REASON = (
    "linear-attention layers keep a per-sequence state and no state checkpoints are saved at block "
    "boundaries, so a cached prefix cannot restore it"
)


def plan_slots(args: ModelArgs, dtype: torch.dtype, max_num_seqs: int, kv_bytes: int) -> int:
    """How many state slots: one per running sequence (``max_num_seqs``), but the states never take more
    memory than the KV pool itself, and at least one slot (a sequence beyond the slots waits for one)."""
    conv, rec = args.linear.state_elements()
    per_seq = len(args.linear_layers) * (conv * dtype.itemsize + rec * 4)
    return max(1, min(max_num_seqs, kv_bytes // per_seq))


class LinearStates:
    def __init__(self, args: ModelArgs, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        spec = args.linear
        self.slots = slots
        self.layers = args.linear_layers
        self.conv = [
            torch.zeros(slots, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
            for _ in self.layers
        ]
        self.recurrent = [
            torch.zeros(slots, spec.num_v_heads, spec.k_dim, spec.v_dim, dtype=torch.float32, device=device)
            for _ in self.layers
        ]
        self.bytes = sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)
        log.info(
            "linear-attention state: %d layers x %d slots, %.1f KiB a sequence (%.1f MiB)",
            len(self.layers),
            slots,
            self.bytes / max(1, slots) / 2**10,
            self.bytes / 2**20,
        )

    def layer_caches(self, args: ModelArgs, kv_caches: list) -> list:
        """What each decoder layer's mixer reads: its (conv, recurrent) state for a linear layer, its KV cache
        (``kv_caches``: one per attention layer, in order) otherwise."""
        states = iter(zip(self.conv, self.recurrent))
        kvs = iter(kv_caches)
        return [next(states) if args.is_linear(i) else next(kvs) for i in range(args.num_layers)]

    def reset(self, slot: int) -> None:
        """A slot handed to a sequence that starts from rest."""
        for t in self.conv + self.recurrent:
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of ``src`` (a forked beam continues its parent's state)."""
        for t in self.conv + self.recurrent:
            t[dst].copy_(t[src])

    def info(self) -> dict:
        """The state group's figures for ``/v1/models`` and the start-up log."""
        return {
            "linear_attention_layers": len(self.layers),
            "linear_state_slots": self.slots,
            "linear_state_bytes_per_sequence": self.bytes // max(1, self.slots),
            "linear_state_bytes": self.bytes,
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
            }
        )
    return groups


def groups_of(runner) -> list[dict]:
    """``cache_groups`` of a ``ModelRunner``: its KV pool (of latents for multi-head latent attention) and
    its state slots."""
    kind = "latent_attention" if runner.model.args.latent is not None else "attention"
    tokens = (runner.num_blocks - 1) * runner.block_size
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
