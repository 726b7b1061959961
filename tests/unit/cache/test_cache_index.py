"""ScopeIndex stays consistent with its vectors through adds, removals and the HNSW switch."""

import numpy as np

from sidecar.cache.index import ScopeIndex


def unit(rng, n, dim=16):
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_flat_search_finds_self_and_forgets_removed():
    rng = np.random.default_rng(0)
    vecs = unit(rng, 20)
    idx = ScopeIndex(16, hnsw_min_entries=1000, use_gpu=False)
    for i, v in enumerate(vecs):
        idx.add(100 + i, v)
    assert idx.kind == "flat"
    sim, eid = idx.search(vecs[3], 1)[0]
    assert eid == 103 and abs(sim - 1.0) < 1e-5
    idx.remove(103)
    assert all(eid != 103 for _, eid in idx.search(vecs[3], 20))
    assert len(idx) == 19


def test_hnsw_switch_and_tombstones_never_return_deleted_ids():
    rng = np.random.default_rng(1)
    vecs = unit(rng, 200)
    idx = ScopeIndex(16, hnsw_min_entries=50, use_gpu=False)
    for i, v in enumerate(vecs):
        idx.add(i, v)
    assert idx.kind == "hnsw"
    removed = set(range(0, 200, 3))
    for i in removed:
        idx.remove(i)
    for i in range(200):
        got = [eid for _, eid in idx.search(vecs[i], 5)]
        assert not removed & set(got)
        if i not in removed:
            assert got[0] == i
    assert len(idx) == 200 - len(removed)


def test_re_adding_an_id_replaces_its_vector():
    rng = np.random.default_rng(2)
    a, b = unit(rng, 2)
    idx = ScopeIndex(16, hnsw_min_entries=1000, use_gpu=False)
    idx.add(7, a)
    idx.add(7, b)
    assert len(idx) == 1
    assert idx.search(b, 1)[0][1] == 7 and idx.search(b, 1)[0][0] > 0.999


def test_broken_gpu_runtime_falls_back_to_cpu(monkeypatch):
    import faiss

    def broken():
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(faiss, "StandardGpuResources", broken, raising=False)
    monkeypatch.setattr("sidecar.cache.index.ScopeIndex._gpu_res", None)
    rng = np.random.default_rng(3)
    vecs = unit(rng, 5)
    idx = ScopeIndex(16, hnsw_min_entries=1000, use_gpu=True)
    for i, v in enumerate(vecs):
        idx.add(i, v)
    assert idx.kind == "flat" and not idx.use_gpu
    idx.remove(2)
    assert [eid for _, eid in idx.search(vecs[2], 5)] and 2 not in [eid for _, eid in idx.search(vecs[2], 5)]


def test_reused_id_after_tombstone_never_returns_the_old_vector():
    rng = np.random.default_rng(4)
    vecs = unit(rng, 60)
    idx = ScopeIndex(16, hnsw_min_entries=10, use_gpu=False)
    for i, v in enumerate(vecs[:50]):
        idx.add(i, v)
    assert idx.kind == "hnsw"
    idx.remove(49)
    idx.add(49, vecs[55])  # same id, different vector
    got = idx.search(vecs[49], 50)
    assert all(not (eid == 49 and sim > 0.99) for sim, eid in got)
    assert idx.search(vecs[55], 1)[0][1] == 49
