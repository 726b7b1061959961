"""Persistent decode inputs: device buffers allocated once, filled in place from one host staging buffer.

A pure-decode step (every row one token) reads its token ids, positions, KV slots, context lengths,
block tables and the rows to sample from views of one int64 device buffer. The host packs all of them
into one staging buffer (pinned on CUDA) and moves them with ONE non-blocking copy, so a step costs no
``torch.tensor(list, device=...)`` (each a blocking copy that syncs the stream) and a captured graph
reads the same addresses on every replay.

Rows are padded up to a batch-size bucket. A padded row decodes token 0 at position 0 with a context
of one token, writes its KV into the reserved block 0 (slot ``j % block_size`` for padded row j) and
reads only that block; its hidden state is computed and never selected. A hybrid model's padded rows step
the scratch state row (``LinearStates.scratch``, right after the slots), which no sequence owns.

A model with KV groups (``kv_groups.py``) has one block table per group per sequence: the buffers then
carry, after group 0's, every further group's slots and tables (the same rows, positions and context
lengths), and ``decode_metadata`` hands each layer the metadata over its group's views.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence

import torch

from sidecar.model.attention import AttentionMetadata


def decode_buckets(max_batch: int, padded: bool) -> list[int]:
    """Batch sizes a decode step is run at. ``padded``: 1, 2, 4, 8, steps of 8 up to 64, steps of 16
    after, and ``max_batch`` itself (what captured graphs need: few shapes); otherwise every size
    1..max_batch (no padding: what the CPU runs, where a padded row costs its full compute)."""
    if max_batch < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_batch}")
    if not padded:
        return list(range(1, max_batch + 1))
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_batch + 1, 16))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket holding ``n`` rows (``buckets`` ascending). Raises ValueError beyond the largest."""
    i = bisect.bisect_left(buckets, n)
    if n < 1 or i == len(buckets):
        raise ValueError(f"decode batch: {n} rows is outside the buckets 1..{buckets[-1]}")
    return buckets[i]


class DecodeRow(NamedTuple):
    token: int
    position: int
    slot: int
    ctx_len: int  # keys [0, ctx_len) of the row's sequence are its context (its own token included)
    table: list[int]  # the sequence's KV block ids (at least ceil(ctx_len / block_size) of them)
    # KV groups 1.. of a grouped model (group 0's are ``slot`` and ``table``): the row's slot and table in each
    group_slots: tuple = ()
    group_tables: tuple = ()
    state_slot: int = 0  # a hybrid model's linear-attention state slot of the row's sequence


def table_width(rows: Sequence[DecodeRow]) -> int:
    """The most blocks any of the rows' tables (every KV group's) holds."""
    return max(len(t) for r in rows for t in (r.table, *r.group_tables))


class DecodeInputs:
    """One int64 device buffer laid out as ids | positions | slots | ctx lens | sample rows | state slots |
    tables (each of the first six ``max_batch`` long, the tables ``max_batch * max_blocks``), then for each KV
    group after the first its slots | tables, its host staging twin, and an int32 copy of group 0's tables
    for device kernels that index with 32-bit ids. The buffers are never reallocated: their ``data_ptr``s
    are what captured graphs and CPU replays hold. ``group_of``: each layer's KV group (None: one group).
    ``state_rows``: a hybrid model's linear-attention state slots, each row's (``DecodeRow.state_slot``) staged
    for the decode metadata, padded rows at row ``state_rows`` (the scratch row; 0: the model keeps none,
    nothing staged)."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        group_of: Optional[Sequence[int]] = None,
        state_rows: int = 0,
    ) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = device
        self.group_of = list(group_of) if group_of is not None else None
        self.num_groups = 1 + max(self.group_of) if self.group_of else 1
        self._table_off = 6 * max_batch
        self._group_len = max_batch * (1 + max_blocks)  # one further group's slots | tables
        self._groups_off = self._table_off + max_batch * max_blocks
        total = self._groups_off + (self.num_groups - 1) * self._group_len
        pin = device.type == "cuda"
        self.staging = torch.zeros(total, dtype=torch.long, pin_memory=pin)
        self._host = self.staging.numpy()
        # On the CPU the staging buffer is the buffer: nothing to copy.
        self.buffer = (
            self.staging if device.type == "cpu" else torch.zeros(total, dtype=torch.long, device=device)
        )
        m = max_batch
        self.ids, self.positions, self.slots, self.ctx_lens, self.sample_rows, self.state_slots = (
            self.buffer[i * m : (i + 1) * m] for i in range(6)
        )
        self.state_rows = state_rows
        self._tables_flat = self.buffer[self._table_off : self._groups_off]
        offs = [self._groups_off + g * self._group_len for g in range(self.num_groups - 1)]
        self.group_slots = [self.buffer[o : o + m] for o in offs]  # KV groups 1..
        self._group_tables_flat = [self.buffer[o + m : o + self._group_len] for o in offs]
        self.tables_i32 = torch.zeros(max_batch * max_blocks, dtype=torch.int32, device=device)
        # Set after each copy on CUDA: the staging buffer is written again only once the copy has read it.
        self._copied = None
        self.bucket = 0  # rows of the last fill (real + padded)
        self.width = 0  # table columns of the last fill
        self.num_sampled = 0
        # The step's ``AttentionMetadata.kv_scores`` (a vector allocated once, kv_scores.SlotScores.received),
        # or None: an unscored step. Reset by every fill; a scored step sets it after its fill.
        self.scores: Optional[torch.Tensor] = None

    def fill(self, rows: Sequence[DecodeRow], sample: Sequence[int], bucket: int, width: int) -> None:
        """Stage ``rows`` padded to ``bucket`` rows with tables ``width`` columns wide (0-padded), and the
        indices of the rows to sample; then one host->device copy. Raises ValueError when they do not fit."""
        n, bs = len(rows), self.block_size
        if not n <= bucket <= self.max_batch or not 1 <= width <= self.max_blocks:
            raise ValueError(
                f"decode batch: {n} rows in a bucket of {bucket} (at most {self.max_batch}) with "
                f"{width} table columns (at most {self.max_blocks}) does not fit the buffers"
            )
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the step's results were read since
        h, m, pad = self._host, self.max_batch, bucket - n
        h[0:n] = [r.token for r in rows]
        h[m : m + n] = [r.position for r in rows]
        h[2 * m : 2 * m + n] = [r.slot for r in rows]
        h[3 * m : 3 * m + n] = [r.ctx_len for r in rows]
        if pad:
            h[n:bucket] = 0
            h[m + n : m + bucket] = 0
            h[2 * m + n : 2 * m + bucket] = [j % bs for j in range(pad)]
            h[3 * m + n : 3 * m + bucket] = 1
        h[4 * m : 4 * m + len(sample)] = sample
        if self.state_rows:  # padded rows step the scratch row, never a sequence's slot
            h[5 * m : 5 * m + n] = [r.state_slot for r in rows]
            h[5 * m + n : 5 * m + bucket] = self.state_rows
        off = self._table_off
        if any(len(r.table) > width for r in rows):
            raise ValueError(
                f"decode batch: a block table of {max(len(r.table) for r in rows)} blocks exceeds "
                f"{width} columns"
            )
        h[off : off + bucket * width] = (
            0  # then each row's blocks (wide tables: max_blocks for graphs and replays)
        )
        for i, r in enumerate(rows):
            h[off + i * width : off + i * width + len(r.table)] = r.table
        used = off + bucket * width  # every staged value lies in this prefix
        if self.num_groups > 1:
            used = self._fill_groups(rows, bucket, width)
        if self.buffer is not self.staging:
            self.buffer[:used].copy_(self.staging[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.bucket, self.width, self.num_sampled = bucket, width, len(sample)
        self.scores = None

    def written(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots the first ``bucket`` rows write and the positions of the tokens written there."""
        return self.slots[:bucket], self.positions[:bucket]

    def _fill_groups(self, rows: Sequence[DecodeRow], bucket: int, width: int) -> int:
        """Stage KV groups 1..'s slots and tables (padded rows as in group 0); returns the staged prefix."""
        h, n, bs, m = self._host, len(rows), self.block_size, self.max_batch
        if any(
            len(r.group_slots) != self.num_groups - 1 or len(r.group_tables) != len(r.group_slots)
            for r in rows
        ):
            raise ValueError(
                f"decode batch: every row needs the slot and table of {self.num_groups} KV groups"
            )
        for g in range(self.num_groups - 1):
            so = self._groups_off + g * self._group_len
            h[so : so + n] = [r.group_slots[g] for r in rows]
            h[so + n : so + bucket] = [j % bs for j in range(bucket - n)]
            off = so + m
            h[off : off + bucket * width] = 0
            for i, r in enumerate(rows):
                t = r.group_tables[g]
                if len(t) > width:
                    raise ValueError(
                        f"decode batch: a block table of {len(t)} blocks exceeds {width} columns"
                    )
                h[off + i * width : off + i * width + len(t)] = t
        return self._groups_off + (self.num_groups - 2) * self._group_len + m + bucket * width

    def one_table(self, rows: Sequence[DecodeRow]) -> list[DecodeRow]:
        """``rows`` with every further KV group's slot and table set to group 0's: for start-up probes and
        timings, whose rows write blocks of their own and never read another group's (unchanged with one group)."""
        n = self.num_groups - 1
        return [r._replace(group_slots=(r.slot,) * n, group_tables=(r.table,) * n) for r in rows]

    def fill_padding(self, bucket: int, width: int) -> None:
        """Every row a padded row (for warm-up and capture: they touch block 0 only)."""
        self.fill([], [], bucket, width)

    def tables(self, bucket: int, width: int) -> torch.Tensor:
        """[bucket, width] view of the int64 tables (contiguous: rows are ``width`` apart)."""
        return self._tables_flat[: bucket * width].view(bucket, width)

    def group_tables(self, g: int, bucket: int, width: int) -> torch.Tensor:
        """[bucket, width] view of KV group ``g + 1``'s int64 tables."""
        return self._group_tables_flat[g][: bucket * width].view(bucket, width)

    def tables_int32(self, bucket: int, width: int) -> torch.Tensor:
        """[bucket, width] int32 copy of the tables, refreshed on the device by this call."""
        out = self.tables_i32[: bucket * width]
        out.copy_(self._tables_flat[: bucket * width])
        return out.view(bucket, width)


def decode_step(model, kv_caches: list, inputs: DecodeInputs, bucket: int) -> torch.Tensor:
    """Hidden states [bucket, H] of the rows in ``inputs``: the function decode graphs capture. It reads
    the buffers only through views and nothing of their contents on the host (no ``.item()``, no
    ``.tolist()``, no data-dependent shapes), so a replay computes from what the buffers hold then."""
    meta = decode_metadata(inputs, bucket)
    if model.fast_paths.attention:
        meta.decode_block_tables_i32 = inputs.tables_int32(bucket, inputs.width)
    return model(inputs.ids[:bucket], inputs.positions[:bucket], kv_caches, meta)


def decode_metadata(inputs: DecodeInputs, bucket: int) -> AttentionMetadata:
    """The attention metadata of the first ``bucket`` rows in the buffers: views of them, no copies."""
    meta = AttentionMetadata(slot_mapping=inputs.slots[:bucket], block_size=inputs.block_size)
    meta.decode_block_tables = inputs.tables(bucket, inputs.width)
    meta.decode_ctx_lens = inputs.ctx_lens[:bucket]
    meta.kv_scores = inputs.scores
    if inputs.state_rows:
        meta.decode_state_slots = inputs.state_slots[:bucket]
    if inputs.num_groups > 1:  # each layer reads its group's slots and tables (rows and contexts shared)
        metas = [meta]
        for g in range(inputs.num_groups - 1):
            m = AttentionMetadata(slot_mapping=inputs.group_slots[g][:bucket], block_size=inputs.block_size)
            m.decode_block_tables = inputs.group_tables(g, bucket, inputs.width)
            m.decode_ctx_lens = meta.decode_ctx_lens
            m.decode_state_slots = meta.decode_state_slots
            m.kv_scores = meta.kv_scores
            metas.append(m)
        meta.layer_metas = [metas[g] for g in inputs.group_of]
    return meta
