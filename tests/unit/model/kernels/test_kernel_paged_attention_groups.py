"""Rows of one sequence in one pass over their context (paged_attention.c's groups): which rows the CPU decode
kernel groups, and that a grouped row's result is bit for bit what a call of that row alone gives, across the
kernel's features (bf16, int8 KV, soft-capping, sinks, sliding windows, received-attention scores)."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import paged_attention as kernel


@pytest.fixture
def one_thread():
    """The kernel with one thread: groups then hold as many rows as their sequences give (on many threads a
    small call keeps a row a task)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Three sequences: four verification rows crossing a block edge, one plain decode row, three rows further on.
SEQS = [(29, 4), (7, 1), (61, 3)]  # (first row's context, rows)


def _batch(nh, nkv, hd, dtype, int8, bs=16, seed=0, seqs=SEQS):
    """q [B, nh, hd], caches, one shuffled block table per sequence of ``seqs`` repeated for its rows, contexts
    growing by one within a sequence; int8: int8 codes with float32 scales."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(c + n - 1) // bs) for c, n in seqs]
    width, num_blocks = max(per_seq), sum(per_seq) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, ctx = [], []
    for (c, n), nb in zip(seqs, per_seq):
        tables += [ids[:nb] + [0] * (width - nb)] * n
        ctx += list(range(c, c + n))
        ids = ids[nb:]
    shape = (num_blocks, bs, nkv, hd)
    if int8:
        kc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        vc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scales = tuple(torch.rand(shape[:3], generator=g) * 0.02 + 0.005 for _ in range(2))
    else:
        kc = torch.randn(shape, generator=g).to(dtype)
        vc = torch.randn(shape, generator=g).to(dtype)
        scales = None
    q = (torch.randn(len(ctx), nh, hd, generator=g) * 2).to(dtype)
    return q, kc, vc, torch.tensor(tables), torch.tensor(ctx), scales


def test_rows_of_one_sequence_are_grouped(one_thread):
    if kernel.vector_width() == 1:  # built without vectors: every row keeps its own pass
        assert kernel.row_groups(torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, 4]), 4, 2, 16) == [
            (0, 1),
            (1, 2),
        ]
        return
    _, _, _, tables, ctx, _ = _batch(9, 3, 64, torch.float32, False)
    assert kernel.row_groups(tables, ctx, 9, 3, 16) == [(0, 4), (4, 5), (5, 8)]
    # windows starting at different positions keep the group
    assert kernel.row_groups(tables, ctx, 9, 3, 16, window=20) == [(0, 4), (4, 5), (5, 8)]
    # a row whose context does not grow by one, or that reads another block, starts a group of its own
    gap = ctx.clone()
    gap[2:4] += 1
    assert kernel.row_groups(tables, gap, 9, 3, 16) == [(0, 2), (2, 4), (4, 5), (5, 8)]
    moved = tables.clone()
    moved[3, 1] = moved[7, 0]
    assert kernel.row_groups(moved, ctx, 9, 3, 16) == [(0, 3), (3, 4), (4, 5), (5, 8)]
    # table columns past a row's context are not compared
    tail = tables.clone()
    tail[1, 3] = 5
    assert kernel.row_groups(tail, ctx, 9, 3, 16) == [(0, 4), (4, 5), (5, 8)]
    # at most 64 queries per KV head: 16 query heads a KV head take four rows a group
    assert kernel.row_groups(tables, ctx, 32, 2, 16) == [(0, 4), (4, 5), (5, 8)]
    assert kernel.row_groups(tables[:4].repeat(2, 1), torch.arange(30, 38), 32, 2, 16) == [(0, 4), (4, 8)]
    # many threads for few rows: a row a task
    assert kernel.row_groups(tables, ctx, 9, 3, 16, threads=64) == [(b, b + 1) for b in range(8)]


def _head_size(vectors):
    width = kernel.vector_width()
    return None if width is None else vectors * width


@pytest.mark.parametrize(
    "nh,nkv,vectors,dtype,int8,window,softcap,sinks,scores",
    [
        (9, 3, 8, torch.float32, False, None, None, False, False),  # SmolLM2's heads: two sums a query
        (9, 3, 8, torch.bfloat16, False, None, None, False, False),
        (14, 2, 8, torch.float32, True, None, None, False, True),  # 7 queries a KV head: grouped values
        (9, 3, 3, torch.float32, False, 20, 30.0, False, False),  # windows starting at odd and even keys
        (4, 4, 3, torch.float32, True, 20, None, True, True),  # one query a KV head; a vector pair and one
        (8, 2, 16, torch.bfloat16, True, None, 50.0, False, True),  # bf16 queries over int8 codes
        (8, 2, 16, torch.bfloat16, False, 33, None, True, False),
        (9, 3, 8, torch.float32, False, 1, None, False, True),  # windows of one key: disjoint contexts
    ],
)
def test_grouped_rows_equal_one_row_calls(
    one_thread, nh, nkv, vectors, dtype, int8, window, softcap, sinks, scores
):
    hd = _head_size(vectors)
    assert hd is not None and kernel.available()
    q, kc, vc, tables, ctx, scales = _batch(nh, nkv, hd, dtype, int8, seed=nh + vectors)
    sink = torch.randn(nh, generator=torch.Generator().manual_seed(1)) if sinks else None
    bs = kc.shape[1]
    if kernel.vector_width() > 1:
        assert kernel.row_groups(tables, ctx, nh, nkv, bs, window) == [(0, 4), (4, 5), (5, 8)]

    together = _together_equals_alone(q, kc, vc, tables, ctx, scales, window, softcap, sink, scores)
    assert together.dtype == dtype


def _together_equals_alone(q, kc, vc, tables, ctx, scales, window, softcap, sink, scores):
    """All rows in one call against each row in a call of its own: equal bits, and with ``scores`` equal
    received-attention sums (the rows' parts added row by row either way: the same sums in the same order).
    Returns the call of all rows."""
    bs, hd = kc.shape[1], q.shape[2]

    def call(rows, acc):
        return kernel.decode_attention(
            q[rows], kc, vc, tables[rows], ctx[rows], hd**-0.5, window, scales, softcap, acc, sink
        )

    together_scores = torch.zeros(kc.shape[0] * bs) if scores else None
    together = call(slice(None), together_scores)
    alone_scores = torch.zeros(kc.shape[0] * bs) if scores else None
    assert together is not None
    for b in range(q.shape[0]):
        assert torch.equal(together[b], call(slice(b, b + 1), alone_scores)[0]), b
    if scores:
        assert torch.equal(together_scores, alone_scores)
        if sink is None:  # every query spreads a weight of one over its keys
            assert together_scores.sum().item() == pytest.approx(q.shape[1] * q.shape[0], rel=1e-4)
    return together


# Contexts whose values an AVX2 build sums in chunks of keys (more than a quarter of a MiB of a head's values)
LONG_SEQS = [(2103, 4), (2300, 1), (2050, 3)]


# (query heads, KV heads, head size, dtype, int8 codes, window, sinks, scores)
LONG = [
    (9, 3, 64, torch.float32, False, None, False, False),  # two sums a query, across chunks
    (14, 2, 64, torch.float32, False, 1101, False, True),  # grouped values; windows from odd and even keys
    (8, 2, 128, torch.bfloat16, False, None, True, False),
    (4, 4, 128, torch.float32, True, None, False, True),  # int8 codes
]


@pytest.mark.parametrize("nh,nkv,hd,dtype,int8,window,sinks,scores", LONG)
def test_long_contexts_summed_in_chunks_equal_one_row_calls(
    one_thread, monkeypatch, nh, nkv, hd, dtype, int8, window, sinks, scores
):
    monkeypatch.setenv(
        "SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma"
    )  # the build that sums long contexts in chunks
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert kernel.available() and kernel.vector_width() == 8, cpu_build.reason("paged_attention")
    q, kc, vc, tables, ctx, scales = _batch(nh, nkv, hd, dtype, int8, seed=hd + nh, seqs=LONG_SEQS)
    sink = torch.randn(nh, generator=torch.Generator().manual_seed(2)) if sinks else None
    assert kernel.row_groups(tables, ctx, nh, nkv, kc.shape[1], window) == [(0, 4), (4, 5), (5, 8)]
    together = _together_equals_alone(q, kc, vc, tables, ctx, scales, window, None, sink, scores)
    _assert_near_float64(together, q, kc, vc, tables, ctx, scales, window, None, sink)


def _assert_near_float64(out, q, kc, vc, tables, ctx, scales, window, softcap, sink):
    """Each row of ``out`` against its attention computed in float64 from the same caches."""
    nh, hd, (_, bs, nkv, _) = q.shape[1], q.shape[2], kc.shape
    k = kc.double() * (scales[0].double()[..., None] if scales else 1)
    v = vc.double() * (scales[1].double()[..., None] if scales else 1)
    for b in range(q.shape[0]):
        n = int(ctx[b])
        lo = max(0, n - window) if window else 0
        pos = torch.arange(lo, n)
        slots = tables[b][pos // bs] * bs + pos % bs
        kb = k.reshape(-1, nkv, hd)[slots].repeat_interleave(nh // nkv, 1)
        vb = v.reshape(-1, nkv, hd)[slots].repeat_interleave(nh // nkv, 1)
        logits = torch.einsum("hd,nhd->hn", q[b].double(), kb) * hd**-0.5
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sink is not None:
            logits = torch.cat([logits, sink.double()[:, None]], 1)
        w = logits.softmax(-1)[:, : n - lo]
        ref = torch.einsum("hn,nhd->hd", w, vb)
        tol = 1e-5 if out.dtype == torch.float32 else 2e-2
        assert (out[b].double() - ref).abs().max() <= tol, b


@pytest.mark.parametrize(
    "nh,nkv,hd,dtype,int8,window,softcap,sinks,scores,context",
    [
        (4, 1, 64, torch.float32, False, None, None, False, False, 2100),  # one KV head; values in chunks too
        (8, 1, 128, torch.bfloat16, False, 1501, 30.0, True, True, 1800),
        (
            14,
            2,
            64,
            torch.float32,
            True,
            None,
            None,
            False,
            True,
            1300,
        ),  # int8 codes; two tasks, four threads
        (8, 1, 64, torch.float32, False, None, None, False, False, 1024),
    ],
)
def test_a_long_row_split_across_threads_equals_one_thread(
    nh, nkv, hd, dtype, int8, window, softcap, sinks, scores, context
):
    """Fewer (row, KV head) tasks than threads over a long context: the kernel splits each task's scores by keys
    and its values by elements across the threads (run_split), which must give the one-thread call's bits."""
    q, kc, vc, tables, ctx, scales = _batch(nh, nkv, hd, dtype, int8, seed=hd + nkv, seqs=[(context, 1)])
    sink = torch.randn(nh, generator=torch.Generator().manual_seed(3)) if sinks else None
    threads = torch.get_num_threads()

    def call(n):
        torch.set_num_threads(n)
        acc = torch.zeros(kc.shape[0] * kc.shape[1]) if scores else None
        try:
            out = kernel.decode_attention(
                q, kc, vc, tables, ctx, hd**-0.5, window, scales, softcap, acc, sink
            )
        finally:
            torch.set_num_threads(threads)
        return out, acc

    alone, alone_scores = call(1)
    split, split_scores = call(4)
    assert split is not None and torch.equal(split, alone)
    if scores:
        assert torch.equal(split_scores, alone_scores)
    _assert_near_float64(split, q, kc, vc, tables, ctx, scales, window, softcap, sink)
