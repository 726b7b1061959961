"""A grouped model's step inputs (``kv_groups.py``): the layers' shared cache tensors, and one
``AttentionMetadata`` per KV group, each over that group's block tables, handed to each layer by
``AttentionMetadata.for_layer``."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from sidecar.engine.input_buffers import DecodeRow
from sidecar.model import mla
from sidecar.model.attention import AttentionMetadata


def layer_caches(a, budget, block_size: int, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """The cache of each layer that keeps one, in layer order (``ModelArgs.kv_shapes``): per-head K/V at the
    layer's own shape (layers reading another's cache keep none; a hybrid model's linear layers keep state
    slots instead), or MLA's latent and rotary key part (mla.py). ``budget`` (``KVBudget``) gives the pool's
    blocks and KV groups: with groups, ``plan.per_group`` caches of each of ``plan.shapes``, the ``j``-th layer
    of every group of a shape on that shape's ``j``-th (a block belongs to one group, so layers sharing a
    tensor never share a block)."""
    plan, num_blocks = budget.plan, budget.num_blocks
    if plan is None:
        return [mla.layer_cache(a, num_blocks, block_size, dtype, device, shape) for shape in a.kv_shapes()]
    storage = [
        mla.layer_cache(a, num_blocks, block_size, dtype, device, shape)
        for shape in plan.shapes or a.kv_shapes()[:1]
        for _ in range(plan.per_group)
    ]
    where, src = plan.storage_of(a.num_layers), a.kv_source
    return [storage[where[i]] for i in range(a.num_layers) if src is None or src[i] == i]


def attach_groups(
    meta: AttentionMetadata,
    kv,
    steps: Sequence,
    num_prefills: int,
    tensor: Callable[[list[int]], torch.Tensor],
) -> int:
    """Give ``meta`` (built over group 0's tables for ``steps``, the scheduled requests in packed order:
    ``num_prefills`` prompt segments, then decode and verification rows) its per-layer metadata: the same
    rows over each group's tables. No grouped request evicts, so a token's cache index is its position.
    Returns the highest block id any group's tables name (what the runner's lazy zeroing must cover before
    the step: a block of one group may lie above every block of group 0)."""
    bs = meta.block_size
    metas = [meta]
    top = 0
    for g in range(1, len(kv.groups)):
        slots: list[int] = []
        segments = []
        dtables: list[list[int]] = []
        for i, s in enumerate(steps):
            r = s.request
            c, n = r.num_computed_tokens, s.num_new_tokens
            table = kv.block_ids(r, g)
            top = max(top, max(table))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            if i < num_prefills:
                seg = meta.prefills[i]
                segments.append(replace(seg, block_table=tensor(table[: -(-seg.ctx_len // bs)])))
            else:
                dtables.extend([table] * n)
        m = AttentionMetadata(slot_mapping=tensor(slots), block_size=bs, prefills=segments)
        m.use_cpu_kernel = meta.use_cpu_kernel
        if dtables:
            width = meta.decode_block_tables.shape[1]
            m.decode_block_tables = tensor([t + [0] * (width - len(t)) for t in dtables]).view(
                len(dtables), width
            )
            m.decode_ctx_lens = meta.decode_ctx_lens
        metas.append(m)
    group_of = kv.plan.group_of()
    meta.layer_metas = [metas[g] for g in group_of]
    return top


def group_rows(rows: Sequence[DecodeRow], reqs: Sequence, kv) -> tuple[list[DecodeRow], int]:
    """``rows`` (row i decodes the token of ``reqs[i]`` at cache index ``ctx_len - 1``, group 0's slot and table
    set) with their slot and table in every further KV group, for the persistent decode buffers. No grouped
    request evicts, so a token's cache index is its position. Returns them and the highest block id any
    group's tables name (what the runner's lazy zeroing must cover before the step)."""
    bs, n = kv.block_size, len(kv.groups)
    tables: dict[str, list[list[int]]] = {}
    out, top = [], 0
    for row, r in zip(rows, reqs):
        ts = tables.get(r.request_id)
        if ts is None:
            ts = tables[r.request_id] = [kv.block_ids(r, g) for g in range(1, n)]
            top = max(top, max(row.table), *(max(t) for t in ts))
        p = row.ctx_len - 1
        slots = tuple(t[p // bs] * bs + p % bs for t in ts)
        out.append(row._replace(group_slots=slots, group_tables=tuple(ts)))
    return out, top
