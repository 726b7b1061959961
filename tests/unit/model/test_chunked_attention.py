"""Chunked local attention (attention_local.py): every path that reads chunks as block-table slices (torch, the
CPU decode and prefill kernels, the Triton decode kernel in its interpreter on CPU, an int8 cache, received-
attention scores) equals the explicit chunk mask of ``reference``, on decode rows and prompt segments that cross
chunk edges; a chunk that is not a whole number of blocks takes the reference path and says so."""

from __future__ import annotations

import logging

import pytest
import torch

from sidecar.model import attention_local, kv_quant
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.kernels.gpu_paths import FastPaths, triton_available

BS, CHUNK, NH, NKV, HD = 8, 16, 4, 2, 16
# prompt segments (cached tokens before them, new tokens): one from its start across two chunk edges, one
# after a cached prefix across an edge, one inside a chunk; decode rows at chunk edges and inside chunks
SEGMENTS = [(0, 37), (10, 20), (17, 5)]
DECODE_CTX = [1, 15, 16, 17, 32, 33, 47]


def _step(dtype: torch.dtype, use_cpu_kernel: bool, seed: int = 0):
    """Random q and a random cache with every context's tokens written, and the step's metadata: segments first,
    then the decode rows, each sequence on its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in SEGMENTS] + DECODE_CTX
    need = [(n + BS - 1) // BS for n in lens]
    ids = (torch.randperm(sum(need), generator=g) + 1).tolist()  # block 0 stays padding
    tables, at = [], 0
    for n in need:
        tables.append(torch.tensor(ids[at : at + n]))
        at += n
    k_cache = torch.randn(sum(need) + 1, BS, NKV, HD, generator=g).to(dtype)
    v_cache = torch.randn(sum(need) + 1, BS, NKV, HD, generator=g).to(dtype)
    t = sum(n for _, n in SEGMENTS) + len(DECODE_CTX)
    q = torch.randn(t, NH, HD, generator=g).to(dtype)
    prefills, qs = [], 0
    for (start, n), table in zip(SEGMENTS, tables):
        prefills.append(PrefillSegment(q_start=qs, q_len=n, ctx_len=start + n, block_table=table))
        qs += n
    width = max(need[len(SEGMENTS) :])
    dec = torch.zeros(len(DECODE_CTX), width, dtype=torch.long)
    for i, table in enumerate(tables[len(SEGMENTS) :]):
        dec[i, : len(table)] = table
    # each new token's slot (the cache is written already; the whole-prompt path reads them for scores)
    pos = [torch.arange(start, start + n) for start, n in SEGMENTS] + [
        torch.tensor([c - 1]) for c in DECODE_CTX
    ]
    slots = torch.cat([table[p // BS] * BS + p % BS for table, p in zip(tables, pos)])
    meta = AttentionMetadata(
        slot_mapping=slots, block_size=BS, prefills=prefills, use_cpu_kernel=use_cpu_kernel
    )
    meta.decode_block_tables, meta.decode_ctx_lens = dec, torch.tensor(DECODE_CTX)
    new = [
        torch.cat([_rows(c, table, *seg) for table, seg in zip(tables, SEGMENTS)] + [c[dec[:, 0], 0]])
        for c in (k_cache, v_cache)
    ]  # the step's new keys and values, in packed order (the decode rows' are not read: written already)
    return q, new[0], new[1], k_cache, v_cache, meta


def _rows(cache, table, start, n):
    """The cached keys (or values) of positions [start, start + n) of the sequence on ``table``."""
    pos = torch.arange(start, start + n)
    return cache[table[pos // BS], pos % BS]


def _chunked(q, k, v, kc, vc, meta, paths=None, kv_scales=None):
    return attention_local.chunked_attention(q, k, v, kc, vc, meta, HD**-0.5, CHUNK, paths, kv_scales)


@pytest.mark.parametrize("use_cpu_kernel", [False, True])
def test_float32_paths_equal_the_chunk_mask(use_cpu_kernel):
    q, k, v, kc, vc, meta = _step(torch.float32, use_cpu_kernel)
    ref = attention_local.reference(q, kc, vc, meta, HD**-0.5, CHUNK)
    got = _chunked(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)
    # the chunks change the rows past their first chunk: full causal attention is something else
    full = attention_local.reference(q, kc, vc, meta, HD**-0.5, 1 << 20)
    first = (
        torch.cat([torch.arange(s, s + n) for s, n in SEGMENTS] + [torch.tensor(DECODE_CTX) - 1])
    ) < CHUNK
    assert torch.allclose(full[first], ref[first], atol=2e-6, rtol=2e-5)
    assert (full[~first] - ref[~first]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_bf16_runs_the_cpu_kernels_to_the_chunk_mask():
    q, k, v, kc, vc, meta = _step(torch.bfloat16, True)
    ref = attention_local.reference(q.float(), kc.float(), vc.float(), meta, HD**-0.5, CHUNK)
    got = _chunked(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_int8_cache_and_received_attention_equal_the_chunk_mask():
    q, k, v, kc, vc, meta = _step(torch.float32, False)
    codes = [torch.zeros(kc.shape, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(kc.shape[:3]) for _ in range(2)]
    slots = torch.arange(kc.shape[0] * BS)
    kv_quant.write((*codes, *scales), kc.view(-1, NKV, HD), vc.view(-1, NKV, HD), slots)
    ref = attention_local.reference(q, codes[0], codes[1], meta, HD**-0.5, CHUNK, tuple(scales))
    for cpu in (False, True):
        meta.use_cpu_kernel = cpu
        got = _chunked(q, k, v, codes[0], codes[1], meta, kv_scales=tuple(scales))
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    meta.use_cpu_kernel = False
    ref_scores = meta.kv_scores = torch.zeros(kc.shape[0] * BS)
    ref = attention_local.reference(q, kc, vc, meta, HD**-0.5, CHUNK)
    got_scores = meta.kv_scores = torch.zeros(kc.shape[0] * BS)
    got = _chunked(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(got_scores, ref_scores, atol=1e-5, rtol=1e-5)
    assert ref_scores.sum() > 0


@pytest.mark.skipif(not triton_available(), reason="no Triton in this install")
def test_triton_decode_kernel_takes_chunk_local_tables(monkeypatch):
    from sidecar.model.kernels.triton import attention as triton_attention

    q, k, v, kc, vc, meta = _step(torch.float32, False)
    meta.prefills = []
    b = len(DECODE_CTX)
    q, k, v, meta.slot_mapping = q[-b:], k[-b:], v[-b:], meta.slot_mapping[-b:]
    calls = []
    real = triton_attention.paged_decode_attention
    monkeypatch.setattr(
        triton_attention, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    paths = FastPaths()
    paths.attention = True
    got = _chunked(q, k, v, kc, vc, meta, paths=paths)
    assert calls
    torch.testing.assert_close(
        got, attention_local.reference(q, kc, vc, meta, HD**-0.5, CHUNK), atol=1e-5, rtol=1e-4
    )


def test_a_chunk_across_blocks_takes_the_reference_path_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(attention_local, "_refusals_logged", set())
    q, k, v, kc, vc, meta = _step(torch.float32, True)
    with caplog.at_level(logging.INFO, logger="sidecar.model.attention_local"):
        got = attention_local.chunked_attention(q, k, v, kc, vc, meta, HD**-0.5, 12)
    assert "chunk 12 is not a multiple of the KV block size 8" in caplog.text
    torch.testing.assert_close(got, attention_local.reference(q, kc, vc, meta, HD**-0.5, 12))
