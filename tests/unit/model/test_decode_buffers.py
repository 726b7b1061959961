"""Persistent decode inputs and the bucketed decode step: buckets, padding, fixed addresses, no host reads."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM
from sidecar.engine.input_buffers import (
    DecodeInputs,
    DecodeRow,
    decode_buckets,
    decode_metadata,
    decode_step,
    pick_bucket,
)
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("max_batch", [1, 7, 50, 64, 256])
def test_padded_bucket_boundaries(max_batch):
    buckets = decode_buckets(max_batch, padded=True)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
    assert buckets[:4] == [b for b in (1, 2, 4, 8) if b < max_batch][:4] or max_batch <= 8
    for i, b in enumerate(buckets):
        assert pick_bucket(buckets, b) == b  # a bucket-sized batch runs unpadded
        if i + 1 < len(buckets):
            assert pick_bucket(buckets, b + 1) == buckets[i + 1]  # one more row: the next bucket
        else:
            with pytest.raises(ValueError, match="decode batch"):
                pick_bucket(buckets, b + 1)
    # steps of at most 16 beyond 8: padding never more than doubles a small batch nor adds 16 rows
    assert all(nxt - cur <= max(cur, 16) for cur, nxt in zip(buckets, buckets[1:]))
    if max_batch == 256:
        assert buckets[:6] == [1, 2, 4, 8, 16, 24] and 64 in buckets and 80 in buckets and 72 not in buckets


def test_exact_buckets_never_pad():
    buckets = decode_buckets(33, padded=False)
    assert [pick_bucket(buckets, n) for n in range(1, 34)] == list(range(1, 34))
    with pytest.raises(ValueError, match="decode batch"):
        pick_bucket(buckets, 0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0, padded=True)


def test_fill_pads_rows_into_block_zero():
    inp = DecodeInputs(max_batch=8, max_blocks=4, block_size=4, device=torch.device("cpu"))
    rows = [DecodeRow(11, 5, 2 * 4 + 1, 6, [3, 2]), DecodeRow(12, 0, 7 * 4, 1, [7])]
    inp.fill(rows, [1], bucket=4, width=3)
    assert inp.ids[:4].tolist() == [11, 12, 0, 0]
    assert inp.positions[:4].tolist() == [5, 0, 0, 0]
    assert inp.slots[:4].tolist() == [9, 28, 0, 1]  # padded rows write slots 0.. of the reserved block 0
    assert inp.ctx_lens[:4].tolist() == [6, 1, 1, 1]
    assert inp.tables(4, 3).tolist() == [[3, 2, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert (
        inp.tables_int32(4, 3).dtype == torch.int32
        and inp.tables_int32(4, 3).tolist() == inp.tables(4, 3).tolist()
    )
    assert inp.sample_rows[: inp.num_sampled].tolist() == [1]
    # a second, smaller fill leaves no stale values in the rows it uses
    inp.fill([DecodeRow(13, 2, 3, 3, [1, 5, 6])], [0], bucket=2, width=3)
    assert inp.ids[:2].tolist() == [13, 0] and inp.ctx_lens[:2].tolist() == [3, 1]
    assert inp.tables(2, 3).tolist() == [[1, 5, 6], [0, 0, 0]]
    with pytest.raises(ValueError, match="decode batch"):
        inp.fill(rows, [], bucket=1, width=3)
    with pytest.raises(ValueError, match="decode batch"):
        inp.fill([DecodeRow(1, 0, 0, 1, [1, 2, 3, 4])], [], bucket=1, width=3)


def test_grouped_fill_stages_every_groups_slots_and_tables():
    # layers 0 and 2 in group 0, layer 1 in group 1, layer 3 in group 2
    inp = DecodeInputs(8, 4, 4, torch.device("cpu"), group_of=[0, 1, 0, 2])
    assert inp.num_groups == 3
    rows = [
        DecodeRow(11, 5, 2 * 4 + 1, 6, [3, 2], (6 * 4 + 1, 4 * 4 + 1), ([0, 6], [5, 4])),
        DecodeRow(12, 0, 7 * 4, 1, [7], (8 * 4, 9 * 4), ([8], [9])),
    ]
    inp.fill(rows, [0, 1], bucket=3, width=3)
    assert inp.slots[:3].tolist() == [9, 28, 0]
    assert [s[:3].tolist() for s in inp.group_slots] == [[25, 32, 0], [17, 36, 0]]  # padding: block 0
    assert inp.group_tables(0, 3, 3).tolist() == [[0, 6, 0], [8, 0, 0], [0, 0, 0]]
    assert inp.group_tables(1, 3, 3).tolist() == [[5, 4, 0], [9, 0, 0], [0, 0, 0]]
    meta = decode_metadata(inp, 3)
    per_layer = [m.decode_block_tables.tolist() for m in meta.layer_metas]
    assert meta.layer_metas[0] is meta and meta.layer_metas[2] is meta
    assert (
        per_layer[1] == inp.group_tables(0, 3, 3).tolist()
        and per_layer[3] == inp.group_tables(1, 3, 3).tolist()
    )
    assert meta.layer_metas[3].slot_mapping.data_ptr() == inp.group_slots[1].data_ptr()  # views, no copies
    assert all(m.decode_ctx_lens.tolist() == [6, 1, 1] for m in meta.layer_metas)
    with pytest.raises(ValueError, match="3 KV groups"):
        inp.fill([DecodeRow(1, 0, 0, 1, [1])], [], bucket=1, width=3)
    with pytest.raises(ValueError, match="decode batch"):
        inp.fill([DecodeRow(1, 0, 0, 1, [1], (4, 8), ([1], [2, 2, 2, 2]))], [], bucket=1, width=3)
    # one group: the buffers and metadata of before (no per-layer metadata)
    assert decode_metadata(DecodeInputs(8, 4, 4, torch.device("cpu")), 1).layer_metas is None


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=8)


def _prefill(runner, prompts, tables):
    """Writes the prompts' KV through a plain eager forward (the reference path)."""
    bs = runner.block_size
    ids, pos, slots, segs = [], [], [], []
    for p, t in zip(prompts, tables):
        segs.append(PrefillSegment(len(ids), len(p), len(p), torch.tensor(t, dtype=torch.long)))
        ids += p
        pos += range(len(p))
        slots += [t[i // bs] * bs + i % bs for i in range(len(p))]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_size=bs, prefills=segs)
    with torch.inference_mode():
        runner.model(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, meta)


def _eager_decode(runner, rows):
    """Logits of decode rows from tensors built for this call: what the runner did before buffers."""
    width = max(len(r.table) for r in rows)
    meta = AttentionMetadata(slot_mapping=torch.tensor([r.slot for r in rows]), block_size=runner.block_size)
    meta.decode_block_tables = torch.tensor([r.table + [0] * (width - len(r.table)) for r in rows])
    meta.decode_ctx_lens = torch.tensor([r.ctx_len for r in rows])
    with torch.inference_mode():
        h = runner.model(
            torch.tensor([r.token for r in rows]),
            torch.tensor([r.position for r in rows]),
            runner.kv_caches,
            meta,
        )
        return runner.model.compute_logits(h)


def _rows(prompts, tables, tokens, bs, step=0):
    out = []
    for p, t, tok in zip(prompts, tables, tokens):
        c = len(p) + step
        out.append(DecodeRow(tok, c, t[c // bs] * bs + c % bs, c + 1, t[: c // bs + 1]))
    return out


def test_poisoned_inputs_replay_equals_fresh_eager_run(llm):
    """Fill, run, then change every input (tokens, positions, lengths, batch size within the bucket):
    the replayed step must follow the new inputs, equal to a fresh eager run on them."""
    runner = llm.engine.runner
    runner.set_decode_padding(True)
    try:
        bs = runner.block_size
        prompts = [
            [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
            [20, 21, 22],
            [30, 31, 32, 33, 34, 35, 36, 37, 38],
            [9, 8],
        ]
        tables = [[1, 2], [3, 4], [5, 6], [7, 8]]
        _prefill(runner, prompts, tables)
        first = runner.decode_rows(_rows(prompts, tables, [40, 41, 42, 43], bs), [0, 1, 2, 3])
        ptr = runner.inputs.buffer.data_ptr()
        # other tokens, positions one further, 3 rows instead of 4 (still bucket 4): nothing stale
        rows_b = _rows(prompts[:3], tables[:3], [50, 51, 52], bs, step=1)
        got = runner.decode_rows(rows_b, [1, 0])
        ref = _eager_decode(runner, rows_b)
        assert runner.inputs.buffer.data_ptr() == ptr
        assert runner.inputs.bucket == 4
        torch.testing.assert_close(got, ref[[1, 0]], rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == ref[[1, 0]].argmax(-1).tolist()
        assert not torch.allclose(got[1], first[0])  # the inputs really changed the result
    finally:
        runner.set_decode_padding(False)


def test_model_reads_the_persistent_buffers_in_place(llm, monkeypatch):
    """Every decode step hands the model views of the same buffers, never copies."""
    runner = llm.engine.runner
    runner.set_decode_padding(True)
    seen = []
    forward = runner.model.forward

    def spy(ids, pos, kv, meta):
        if meta.decode_block_tables is not None and not meta.prefills:
            seen.append(
                (
                    ids.data_ptr(),
                    pos.data_ptr(),
                    meta.slot_mapping.data_ptr(),
                    meta.decode_ctx_lens.data_ptr(),
                    meta.decode_block_tables.data_ptr(),
                )
            )
        return forward(ids, pos, kv, meta)

    monkeypatch.setattr(runner.model, "forward", spy)
    try:
        inp = runner.inputs
        expected = (
            inp.ids.data_ptr(),
            inp.positions.data_ptr(),
            inp.slots.data_ptr(),
            inp.ctx_lens.data_ptr(),
            inp.tables(1, 1).data_ptr(),
        )
        from sidecar import SamplingParams

        llm.generate(
            [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [16] * 20],
            [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 6, 9)],
        )
    finally:
        runner.set_decode_padding(False)
    assert len(seen) >= 8 and set(seen) == {expected}


def test_decode_step_runs_on_meta_without_host_reads(demo_dir):
    """The captured step on the meta device: any .item(), .tolist(), boolean indexing or nonzero there
    raises, so finishing proves the step makes no host reads (what a CUDA graph requires)."""
    from sidecar.model.loader import load_model
    from sidecar.config import EngineConfig

    with pytest.raises(Exception):
        torch.ones(2, device="meta").sum().item()  # the premise: meta tensors have no values
    args = load_model(EngineConfig(model=str(demo_dir), dtype="float32", device="cpu")).args
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model.init_rope(64, torch.device("meta"), torch.float32)
    shape = (6, 8, args.num_kv_heads, args.head_dim)
    kv = [
        (torch.empty(shape, device="meta"), torch.empty(shape, device="meta")) for _ in range(args.num_layers)
    ]
    inp = DecodeInputs(max_batch=4, max_blocks=3, block_size=8, device=torch.device("meta"))
    for on in (False, True):  # the int32 tables too
        model.fast_paths.attention = on
        inp.fill([DecodeRow(5, 9, 17, 10, [1, 2]), DecodeRow(6, 3, 27, 4, [3])], [0, 1], bucket=4, width=3)
        with torch.inference_mode():
            hidden = decode_step(model, kv, inp, 4)
            logits = model.compute_logits(hidden.index_select(0, inp.sample_rows[:2]))
        assert hidden.device.type == "meta" and hidden.shape == (4, args.hidden_size)
        assert logits.shape == (2, args.vocab_size)
