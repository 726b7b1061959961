"""A forward's inputs as host arrays and back: what rank 0 sends each worker of a split model (tp.py, pp.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from sidecar.model.attention import AttentionMetadata, PrefillSegment


def _np(t: Optional[torch.Tensor]) -> Any:
    return None if t is None else t.detach().cpu().numpy()


def pack_inputs(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
    """A forward's inputs as host arrays (the metadata's device fast-path fields are off under TP)."""
    if meta.kv_scores is not None:
        raise ValueError("kv_budget: scored KV eviction is not supported with tensor parallelism")
    prefills = [(s.q_start, s.q_len, s.ctx_len, _np(s.block_table)) for s in meta.prefills]
    return (
        _np(ids),
        _np(positions),
        _np(meta.slot_mapping),
        meta.block_size,
        prefills,
        _np(meta.decode_block_tables),
        _np(meta.decode_ctx_lens),
        meta.use_cpu_kernel,
    )


def unpack_inputs(msg: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    ids, pos, slots, block_size, prefills, tables, ctx_lens, use_cpu_kernel = msg

    def t(a: Any) -> Optional[torch.Tensor]:
        return None if a is None else torch.from_numpy(a).to(device)

    meta = AttentionMetadata(
        slot_mapping=t(slots),
        block_size=block_size,
        prefills=[PrefillSegment(q0, n, ctx, t(table)) for q0, n, ctx, table in prefills],
        decode_block_tables=t(tables),
        decode_ctx_lens=t(ctx_lens),
        use_cpu_kernel=use_cpu_kernel,
    )
    return t(ids), t(pos), meta
