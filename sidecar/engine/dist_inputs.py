"""A forward's inputs as host arrays and back: what rank 0 sends each worker of a split model (tp.py, pp.py);
the adapters rank 0 writes into its LoRA slots, which every worker writes into the same slots."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from sidecar.config import EngineConfig
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.lora import Adapter, LoraLayers


def _np(t: Optional[torch.Tensor]) -> Any:
    return None if t is None else t.detach().cpu().numpy()


def pack_inputs(
    ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, lora: Optional[LoraLayers] = None
) -> tuple:
    """A forward's inputs as host arrays (the metadata's device fast-path fields are off under TP), with the
    adapter slot of each token (``lora``'s batch; None: every token is the base model's) and a hybrid model's
    state slots (each prompt segment's, each decode row's)."""
    if meta.kv_scores is not None:
        raise ValueError("kv_budget: scored KV eviction is not supported with tensor parallelism")
    prefills = [
        (s.q_start, s.q_len, s.ctx_len, _np(s.block_table), s.state_slot, s.state_start)
        for s in meta.prefills
    ]
    return (
        _np(ids),
        _np(positions),
        _np(meta.slot_mapping),
        meta.block_size,
        prefills,
        _np(meta.decode_block_tables),
        _np(meta.decode_ctx_lens),
        meta.use_cpu_kernel,
        None if lora is None else lora.token_slots,
        _np(meta.decode_state_slots),
    )


def unpack_inputs(
    msg: tuple, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, Optional[list[int]]]:
    """``pack_inputs``' arrays as tensors on ``device``: ids, positions, metadata, tokens' adapter slots."""
    ids, pos, slots, block_size, prefills, tables, ctx_lens, use_cpu_kernel, token_slots, state_slots = msg

    def t(a: Any) -> Optional[torch.Tensor]:
        return None if a is None else torch.from_numpy(a).to(device)

    meta = AttentionMetadata(
        slot_mapping=t(slots),
        block_size=block_size,
        prefills=[PrefillSegment(q0, n, ctx, t(table), *state) for q0, n, ctx, table, *state in prefills],
        decode_block_tables=t(tables),
        decode_ctx_lens=t(ctx_lens),
        use_cpu_kernel=use_cpu_kernel,
        decode_state_slots=t(state_slots),
    )
    return t(ids), t(pos), meta, token_slots


def pack_adapter(slot: int, adapter: Adapter) -> tuple:
    """The message writing ``adapter`` (whole: each rank takes its own slice) into a worker's ``slot``."""
    weights = {key: (A.numpy(), B.numpy()) for key, (A, B) in adapter.weights.items()}
    return ("lora", slot, (adapter.path, adapter.rank, adapter.scaling, weights))


def worker_lora(model: Any, config: EngineConfig) -> Optional[LoraLayers]:
    """A worker's adapter slots, as many as rank 0's (None when LoRA is off), filled in rank 0's order."""
    if not (config.lora_modules or config.enable_lora):
        return None
    return LoraLayers(model, config.max_loras, config.max_lora_rank)


def load_adapter(lora: LoraLayers, msg: tuple) -> None:
    """Write the adapter of a ``pack_adapter`` message into its slot."""
    path, rank, scaling, weights = msg[2]
    tensors = {key: (torch.from_numpy(A), torch.from_numpy(B)) for key, (A, B) in weights.items()}
    lora.load(msg[1], Adapter(path, rank, scaling, tensors))


@contextlib.contextmanager
def lora_batch(lora: Optional[LoraLayers], token_slots: Optional[list[int]]) -> Iterator[None]:
    """A worker's forward with rank 0's adapter slot per token (none: the base model's)."""
    if lora is None or token_slots is None:
        yield
        return
    lora.set_batch(token_slots)
    try:
        yield
    finally:
        lora.set_batch(None)
