"""Micro-batches of a pipeline-parallel step (pp.py): where one step's packed tokens are cut, and the
attention metadata of each part.

A step's tokens are packed as the runner lays them out: prompt segments first (each ``[q_start, q_start +
q_len)``, in order, with no gap), then one row per decode token. A cut falls only between two sequences, so a
sequence's tokens are always in one micro-batch, and every micro-batch is a batch of the same layout (its own
segments, then its own decode rows). Each stage runs a step's micro-batches in order, so a micro-batch sees
the KV cache exactly as the whole step would: its sequences' caches are written by its own rows only. The
same holds for a hybrid model's linear-attention states: a sequence's slot is read and written by its own
rows, all in one part (its prompt segment keeps its slot, its decode row carries it in
``decode_state_slots``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sidecar.model.attention import AttentionMetadata

Bounds = list[tuple[int, int]]  # [start, end) token ranges of the micro-batches, in order, covering the step


def micro_batches(meta: AttentionMetadata, num_tokens: int, parts: int) -> Bounds:
    """Cut a step of ``num_tokens`` into at most ``parts`` micro-batches of about equal token counts, at
    sequence boundaries. One part (the whole step) where ``parts`` is 1, where the step has one sequence, or
    where its metadata is not the plain layout (per-layer KV groups, attention scores). A hybrid model's state
    slots are per sequence, so they are cut with their sequences (``micro_meta``)."""
    whole = [(0, num_tokens)]
    if parts <= 1 or meta.layer_metas is not None or meta.kv_scores is not None:
        return whole
    cuts, end = [], 0
    for seg in meta.prefills:  # each segment starts where the one before ends
        if seg.q_start != end:
            return whole
        cuts.append(seg.q_start)
        end += seg.q_len
    rows = 0 if meta.decode_block_tables is None else meta.decode_block_tables.shape[0]
    if end + rows != num_tokens:
        return whole
    cuts.extend(range(end, num_tokens))  # every decode row starts a sequence of its own
    chosen: list[int] = []
    for j in range(1, parts):  # the sequence start nearest each ideal cut, strictly increasing
        ideal = j * num_tokens / parts
        later = [c for c in cuts if c > (chosen[-1] if chosen else 0)]
        if not later:
            break
        best = min(later, key=lambda c: abs(c - ideal))
        if best < num_tokens:
            chosen.append(best)
    edges = [0, *chosen, num_tokens]
    return [(a, b) for a, b in zip(edges, edges[1:])]


def micro_meta(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """The metadata of tokens ``[start, end)`` of the step (a range ``micro_batches`` returned)."""
    rows = 0 if meta.decode_block_tables is None else meta.decode_block_tables.shape[0]
    first_row = meta.slot_mapping.shape[0] - rows  # token index of decode row 0
    r0, r1 = max(start, first_row) - first_row, max(end, first_row) - first_row

    def dec(t: Optional[object]):
        return None if t is None or r0 == r1 else t[r0:r1]

    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[start:end],
        block_size=meta.block_size,
        prefills=[
            dataclasses.replace(s, q_start=s.q_start - start)
            for s in meta.prefills
            if start <= s.q_start < end
        ],
        decode_block_tables=dec(meta.decode_block_tables),
        decode_ctx_lens=dec(meta.decode_ctx_lens),
        decode_block_tables_i32=dec(meta.decode_block_tables_i32),
        use_cpu_kernel=meta.use_cpu_kernel,
        decode_state_slots=dec(meta.decode_state_slots),
    )
