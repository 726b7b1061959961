"""FAISS vector index over one cache scope.

Vectors are unit-norm, so inner product is cosine similarity. Small indexes use
exact search (``IndexFlatIP``); from ``hnsw_min_entries`` on, the index is
rebuilt as HNSW. With faiss-gpu and a visible GPU, flat indexes live on the GPU.

Consistency invariant: ``search`` only ever returns ids currently in
``self._vectors``. Flat CPU indexes delete in place (``IndexIDMap2.remove_ids``);
HNSW and GPU indexes cannot, so deleted ids are tombstoned, filtered out of
results, and the index is rebuilt from ``self._vectors`` once tombstones pile up.
"""

from __future__ import annotations

import logging
from typing import Optional

import faiss
import numpy as np

log = logging.getLogger("sidecar.cache")

_HNSW_M = 32
_HNSW_EF_SEARCH = 64


def gpu_available() -> bool:
    try:
        return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    except Exception:  # pragma: no cover - broken GPU runtime: fall back to CPU
        return False


class ScopeIndex:
    """Id-addressed vectors with k-NN search by inner product."""

    _gpu_res = None  # one StandardGpuResources per process, created on first GPU use

    def __init__(self, dim: int, hnsw_min_entries: int, use_gpu: Optional[bool] = None):
        self.dim = dim
        self.hnsw_min_entries = hnsw_min_entries
        self.use_gpu = gpu_available() if use_gpu is None else use_gpu
        self._vectors: dict[int, np.ndarray] = {}
        self._tombstones: set[int] = set()
        self._index = None
        self._kind = "flat"

    def __len__(self) -> int:
        return len(self._vectors)

    @property
    def kind(self) -> str:
        """ "flat" or "hnsw" (plus "-gpu" when on the GPU)."""
        return self._kind + ("-gpu" if self.use_gpu and self._kind == "flat" else "")

    def _base(self, n: int):
        if n >= self.hnsw_min_entries:
            base = faiss.IndexHNSWFlat(self.dim, _HNSW_M, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efSearch = _HNSW_EF_SEARCH
            self._kind = "hnsw"
            return base
        self._kind = "flat"
        if self.use_gpu:
            try:
                if ScopeIndex._gpu_res is None:
                    ScopeIndex._gpu_res = faiss.StandardGpuResources()
                return faiss.GpuIndexFlatIP(ScopeIndex._gpu_res, self.dim)
            except Exception as exc:  # a broken GPU runtime must not take the cache down
                log.warning("faiss GPU index unavailable (%s); using the CPU", exc)
                self.use_gpu = False
        return faiss.IndexFlatIP(self.dim)

    def _build(self) -> None:
        n = len(self._vectors)
        base = self._base(n)
        # IndexIDMap2 (CPU) can delete by id; the GPU flat index goes behind the plain IndexIDMap.
        index = faiss.IndexIDMap(base) if self.use_gpu and self._kind == "flat" else faiss.IndexIDMap2(base)
        self._base_ref = base  # keep the wrapped index alive as long as the wrapper
        if n:
            ids = np.fromiter(self._vectors.keys(), dtype=np.int64, count=n)
            index.add_with_ids(np.stack(list(self._vectors.values())), ids)
        self._index = index
        self._tombstones.clear()

    def _deletes_in_place(self) -> bool:
        return self._kind == "flat" and not self.use_gpu

    def add(self, entry_id: int, vector: np.ndarray) -> None:
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(self.dim)
        if entry_id in self._vectors:
            self.remove(entry_id)
        self._vectors[entry_id] = vec
        # A tombstoned copy of this id is still inside the index and would be taken for the
        # new vector: rebuild instead of adding next to it.
        if (
            self._index is None
            or entry_id in self._tombstones
            or (self._kind == "flat" and len(self._vectors) >= self.hnsw_min_entries)
        ):
            self._build()  # first use, reused id, or crossing into HNSW territory
        else:
            self._index.add_with_ids(vec.reshape(1, -1), np.array([entry_id], dtype=np.int64))

    def remove(self, entry_id: int) -> None:
        if self._vectors.pop(entry_id, None) is None:
            return
        if self._deletes_in_place():
            self._index.remove_ids(np.array([entry_id], dtype=np.int64))
            return
        self._tombstones.add(entry_id)
        if len(self._tombstones) > max(64, len(self._vectors) // 4):
            self._build()

    def search(self, query: np.ndarray, k: int) -> list[tuple[float, int]]:
        """Up to ``k`` live (similarity, id) pairs, most similar first."""
        if not self._vectors or self._index is None:
            return []
        want = min(len(self._vectors), k) + len(self._tombstones)
        sims, ids = self._index.search(np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1), want)
        out = []
        for s, i in zip(sims[0], ids[0]):
            if i >= 0 and int(i) in self._vectors:
                out.append((float(s), int(i)))
        return out[:k]
