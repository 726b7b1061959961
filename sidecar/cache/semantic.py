"""Request-level semantic cache: exact tier, then FAISS similarity tier with a guard.

Scope: an entry is only ever visible to lookups with the same tenant, model,
answer-changing sampling settings and conversation context (system prompt and
earlier turns). Each scope has its own vector index, so a search can never
return another scope's (or tenant's) entry.

Tiers: (1) exact: hash of the scope plus the normalised query; (2) semantic:
nearest neighbours of the query embedding inside the scope with similarity >=
``CacheConfig.threshold`` that also pass ``guard.check``.

Bounds: entries older than ``ttl_s`` are never served and are removed; beyond
``max_entries`` the least recently used entry goes. Every removal deletes the
exact-key mapping and the vector together, and the persisted copy after them.

Visibility: an answer is in the in-memory tiers (exact key and vector) as soon as
``insert`` returns; persistence (the SQLite file, or Redis shared by replicas, see
``sidecar.cache.backend``) follows on one writer thread, in order. With Redis, other
replicas' entries arrive through ``apply_put`` / ``apply_delete``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import json
import logging
import re
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from sidecar.cache import guard
from sidecar.cache.backend import open_backend
from sidecar.cache.embedder import Embedder
from sidecar.cache.index import ScopeIndex
from sidecar.cache.policy import CachePolicy, cache_policy  # noqa: F401  (public names of this module)
from sidecar.cache.store import Entry
from sidecar.config import CacheConfig

log = logging.getLogger("sidecar.cache")

STORABLE_FINISH = ("stop", "length")
_CANDIDATES = 4  # neighbours checked by the guard before giving up
_VECTOR_MEMO = 2048  # recent query vectors, so store() after a miss does not re-embed
_INLINE_CHARS = 8192  # lookups of a scope + query up to this size run on the event loop (see lookup)
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class CacheScope:
    tenant: str
    model: str
    settings: str
    context: str
    query: str


@dataclass
class CacheHit:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    similarity: float
    matched_query: str
    kind: str  # "exact" | "semantic"
    entry_id: int = 0


def normalize_query(query: str) -> str:
    """Form that is embedded: Unicode-normalised, whitespace collapsed."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", query)).strip()


def _exact_form(query: str) -> str:
    # Case, spacing and trailing punctuation never change what is asked.
    return normalize_query(query).casefold().rstrip(" ?!.")


def scope_key(scope: CacheScope) -> str:
    raw = json.dumps([scope.tenant, scope.model, scope.settings, scope.context], ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


def exact_key(scope: CacheScope) -> str:
    raw = json.dumps([scope_key(scope), _exact_form(scope.query)], ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


class SemanticCache:
    """See the module docstring. ``clock`` returns wall-clock seconds (injectable for TTL tests)."""

    def __init__(
        self,
        cfg: CacheConfig,
        embedder: Optional[Embedder] = None,
        clock: Callable[[], float] = time.time,
        use_gpu: Optional[bool] = None,
    ):
        cfg.validate()
        self.cfg = cfg
        self._own_embedder = embedder is None
        self.embedder = embedder or Embedder(cfg.embedding_model)
        self._clock = clock
        self._use_gpu = use_gpu
        # All in-memory state below is guarded by _lock; SQLite has its own lock.
        self._lock = threading.Lock()
        self._entries: "OrderedDict[int, Entry]" = OrderedDict()  # LRU order: oldest first
        self._by_key: dict[str, int] = {}
        self._scopes: dict[str, ScopeIndex] = {}
        self._vectors: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._embedding: dict[str, asyncio.Task] = {}  # embeddings in flight, by text (event loop only)
        self._counters = dict(
            lookups=0,
            exact_hits=0,
            semantic_hits=0,
            misses=0,
            guard_rejections=0,
            bypasses=0,
            stores=0,
            store_refused=0,
            store_failed=0,
            store_busy=0,
            evictions=0,
            expired=0,
            quarantined=0,
        )
        self._last_sweep = clock()
        self._ids = itertools.count(1)  # in-memory ids; the backend knows entries by exact key
        # One writer thread: persistence happens in the order the memory changed.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sidecar-cache-writer")
        try:
            self._backend = open_backend(cfg, self.embedder.model_name, self.embedder.dim)
        except BaseException:
            self._writer.shutdown(wait=False)
            if self._own_embedder:  # nothing else holds the worker thread we may have started
                self.embedder.close()
            raise
        self._store = getattr(self._backend, "store", None)  # the SQLite store, when that is the backend
        self._load()
        self._backend.start(self)

    # -- startup ----------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the in-memory maps and indexes from SQLite, dropping what expired meanwhile."""
        now = self._clock()
        stale = []
        for e in self._backend.load_all():
            if self._expired(e, now) or e.vector.shape != (self.embedder.dim,):
                stale.append(e)
                continue
            e.id = next(self._ids)
            self._insert_memory(e)
        self._backend.delete(stale)
        self._counters["expired"] += len(stale)
        self._counters["quarantined"] += self._backend.quarantined
        self._evict_over_capacity()

    # -- helpers (caller holds _lock) --------------------------------------
    def _expired(self, e: Entry, now: float) -> bool:
        return now - e.created_at >= self.cfg.ttl_s

    def _index_for(self, skey: str) -> ScopeIndex:
        idx = self._scopes.get(skey)
        if idx is None:
            idx = self._scopes[skey] = ScopeIndex(self.embedder.dim, self.cfg.hnsw_min_entries, self._use_gpu)
        return idx

    def _insert_memory(self, e: Entry) -> None:
        self._entries[e.id] = e
        self._by_key[e.exact_key] = e.id
        self._index_for(e.scope_key).add(e.id, e.vector)

    def _drop_memory(self, entry_id: int) -> Optional[Entry]:
        e = self._entries.pop(entry_id, None)
        if e is None:
            return None
        if self._by_key.get(e.exact_key) == entry_id:
            del self._by_key[e.exact_key]
        idx = self._scopes.get(e.scope_key)
        if idx is not None:
            idx.remove(entry_id)
            if len(idx) == 0:
                del self._scopes[e.scope_key]
        return e

    def _remove(self, ids: list[int], counter: str) -> None:
        gone = [e for e in (self._drop_memory(i) for i in ids) if e is not None]
        if gone:
            self._writer.submit(self._persist_delete, gone)
        self._counters[counter] += len(gone)

    def _persist_delete(self, gone: list[Entry]) -> None:
        try:
            self._backend.delete(gone)
        except Exception as exc:  # rows left behind are dropped again at the next start (expired or evicted)
            log.warning("semantic cache: could not delete %d persisted entries: %s", len(gone), exc)

    def _evict_over_capacity(self) -> None:
        over = len(self._entries) - self.cfg.max_entries
        if over > 0:
            self._remove(list(itertools.islice(self._entries.keys(), over)), "evictions")

    def _sweep(self, now: float) -> None:
        # Expired entries are never served (checked on use); this pass, run by stores at most once
        # per min(ttl/10, 60 s), frees the ones nobody asks for again without making each store O(n).
        if now - self._last_sweep < min(60.0, self.cfg.ttl_s / 10):
            return
        self._last_sweep = now
        self._remove([i for i, e in self._entries.items() if self._expired(e, now)], "expired")

    def _hit(self, e: Entry, similarity: float, kind: str, now: float) -> CacheHit:
        self._entries.move_to_end(e.id)
        e.last_access = now
        self._counters["exact_hits" if kind == "exact" else "semantic_hits"] += 1
        hit = CacheHit(
            text=e.text,
            token_ids=list(e.token_ids),
            finish_reason=e.finish_reason,
            prompt_tokens=e.prompt_tokens,
            completion_tokens=e.completion_tokens,
            similarity=similarity,
            matched_query=e.query,
            kind=kind,
            entry_id=e.id,
        )
        hit._entry = e  # for the touch after the lock is released
        return hit

    def _touch(self, hit: Optional[CacheHit], now: float) -> None:
        """Persist a hit's LRU position behind the answer, on the writer thread (in order with the other
        writes); best effort: a busy or failing file is counted, never waited for by the hit."""
        if hit is not None:
            self._writer.submit(self._persist_touch, hit._entry, now)

    def _persist_touch(self, e: Entry, now: float) -> None:
        if not self._backend.touch(e, now):
            with self._lock:
                self._counters["store_busy"] += 1

    def _memo(self, text: str, vec: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        if vec is None:
            return self._vectors.get(text)
        self._vectors[text] = vec
        self._vectors.move_to_end(text)
        while len(self._vectors) > _VECTOR_MEMO:
            self._vectors.popitem(last=False)
        return vec

    async def _embed(self, text: str) -> np.ndarray:
        """The query's vector, memoised. Concurrent callers with one text share one embedding (a burst
        of identical questions embeds once); it runs as its own task, so a caller that is cancelled
        never cancels it for the others."""
        with self._lock:
            vec = self._memo(text)
        if vec is not None:
            return vec
        loop = asyncio.get_running_loop()
        task = self._embedding.get(text)
        if task is None or task.get_loop() is not loop:
            task = self._embedding[text] = loop.create_task(self._embed_now(text))
        return await asyncio.shield(task)

    async def _embed_now(self, text: str) -> np.ndarray:
        try:
            vec = (await self.embedder.aembed([text]))[0]
            with self._lock:
                self._memo(text, vec)
            return vec
        finally:
            self._embedding.pop(text, None)

    # -- public API ---------------------------------------------------------
    async def lookup(self, scope: CacheScope) -> Optional[CacheHit]:
        """Return a stored answer for this scope and query, or None.

        Lookups read memory only (a hit's persisted LRU position is written behind it). For a scope and
        query under ``_INLINE_CHARS`` the hashing, the FAISS search and the guard take microseconds and
        run on the event loop, saving two thread hand-offs per lookup; larger ones run in a worker thread,
        so a huge query never holds the loop. The embedding always runs on the embedder's thread.
        """
        now = self._clock()
        small = len(scope.context) + len(scope.query) <= _INLINE_CHARS
        if small:
            hit, skey, query = self._lookup_exact(scope, now)
        else:
            hit, skey, query = await asyncio.to_thread(self._lookup_exact, scope, now)
        if hit is not None or skey is None:
            return hit
        vec = await self._embed(query)
        if small:
            return self._lookup_similar(skey, query, vec, now)
        return await asyncio.to_thread(self._lookup_similar, skey, query, vec, now)

    def _lookup_exact(self, scope: CacheScope, now: float) -> tuple:
        """(hit, None, None) for an exact hit, (None, None, None) for a certain miss, else
        (None, scope key, normalised query) for the similarity tier."""
        skey, ekey = scope_key(scope), exact_key(scope)
        with self._lock:
            self._counters["lookups"] += 1
            eid = self._by_key.get(ekey)
            hit = None
            if eid is not None:
                e = self._entries[eid]
                if not self._expired(e, now):
                    hit = self._hit(e, 1.0, "exact", now)
                else:
                    self._remove([eid], "expired")
            if hit is None and skey not in self._scopes:  # nothing to compare against: skip the embedding
                self._counters["misses"] += 1
                return None, None, None
        if hit is not None:
            self._touch(hit, now)
            return hit, None, None
        return None, skey, normalize_query(scope.query)

    def _lookup_similar(self, skey: str, query: str, vec: np.ndarray, now: float) -> Optional[CacheHit]:
        with self._lock:
            idx = self._scopes.get(skey)
            candidates = idx.search(vec, _CANDIDATES) if idx is not None else []
            rejected = False
            hit = None
            for sim, eid in candidates:
                if sim < self.cfg.threshold:
                    break
                e = self._entries.get(eid)
                if e is None:
                    continue
                if self._expired(e, now):
                    self._remove([eid], "expired")
                    continue
                reason = guard.check(query, e.query) if self.cfg.guard else None
                if reason is not None:
                    rejected = True
                    log.debug("semantic hit refused (%s): %r vs %r sim=%.4f", reason, query, e.query, sim)
                    continue
                hit = self._hit(e, min(sim, 1.0), "semantic", now)
                break
            if hit is None:
                self._counters["guard_rejections"] += int(rejected)
                self._counters["misses"] += 1
        self._touch(hit, now)
        return hit

    async def query_vector(self, scope: CacheScope) -> np.ndarray:
        """The embedding of the scope's normalised query (memoised: a lookup's vector is reused)."""
        return await self._embed(normalize_query(scope.query))

    def insert(
        self,
        scope: CacheScope,
        text: str,
        token_ids: list[int],
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        vec: np.ndarray,
    ) -> Optional[Entry]:
        """Put an answer into the in-memory tiers now (replacing one with the same exact key) and return
        it for ``persist``; None (counted) when ``finish_reason`` is not storable. Blocking only on
        ``_lock``: run it in a worker thread."""
        if finish_reason not in STORABLE_FINISH:
            with self._lock:
                self._counters["store_refused"] += 1
            return None
        now = self._clock()
        e = Entry(
            id=0,
            exact_key=exact_key(scope),
            scope_key=scope_key(scope),
            query=normalize_query(scope.query),
            text=text,
            token_ids=[int(t) for t in token_ids],
            finish_reason=finish_reason,
            prompt_tokens=int(prompt_tokens),
            completion_tokens=int(completion_tokens),
            vector=np.asarray(vec, dtype=np.float32),
            created_at=now,
            last_access=now,
        )
        with self._lock:
            self._replace_memory(e)
            self._counters["stores"] += 1
            self._evict_over_capacity()
            self._sweep(now)
        return e

    def _replace_memory(self, e: Entry) -> None:  # caller holds _lock
        e.id = next(self._ids)
        old = self._by_key.get(e.exact_key)
        if old is not None:
            self._drop_memory(old)
        self._insert_memory(e)

    def persist(self, e: Entry) -> "concurrent.futures.Future":
        """Write ``e`` to the backend behind the response, after every earlier change; the future
        raises what the backend raised (counted in ``store_failed``)."""
        return self._writer.submit(self._persist_put, e)

    def _persist_put(self, e: Entry) -> None:
        try:
            self._backend.put(e)
        except Exception:
            with self._lock:
                self._counters["store_failed"] += 1
            raise

    async def store(
        self,
        scope: CacheScope,
        text: str,
        token_ids: list[int],
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Store a completed generation (finish ``stop``/``length``; anything else is refused) and wait
        until it is persisted; a persistence error is raised (the entry stays in memory)."""
        if finish_reason not in STORABLE_FINISH:
            with self._lock:
                self._counters["store_refused"] += 1
            return
        vec = await self.query_vector(scope)
        e = await asyncio.to_thread(
            self.insert, scope, text, token_ids, finish_reason, prompt_tokens, completion_tokens, vec
        )
        await asyncio.wrap_future(self.persist(e))

    # -- other replicas' changes (called by the backend's follower thread) ----------
    def apply_put(self, e: Entry) -> None:
        """Mirror an entry another replica stored; an older or expired copy is ignored."""
        now = self._clock()
        if self._expired(e, now) or e.vector.shape != (self.embedder.dim,):
            return
        with self._lock:
            old = self._by_key.get(e.exact_key)
            if old is not None and self._entries[old].created_at >= e.created_at:
                return
            e.last_access = now
            self._replace_memory(e)
            over = len(self._entries) - self.cfg.max_entries
            for eid in list(itertools.islice(self._entries.keys(), max(0, over))):
                self._drop_memory(eid)  # the replica that stored it persists its own evictions
                self._counters["evictions"] += 1

    def apply_delete(self, exact_key_: str, created_at: float) -> None:
        """Another replica removed this entry (evicted or expired); a newer copy stays."""
        with self._lock:
            eid = self._by_key.get(exact_key_)
            if eid is not None and self._entries[eid].created_at <= created_at:
                self._drop_memory(eid)

    def record_bypass(self, reason: str) -> None:
        with self._lock:
            self._counters["bypasses"] += 1

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counters)
            out["entries"] = len(self._entries)
            out["scopes"] = len(self._scopes)
        out.update(self._backend.stats())
        return out

    def close(self) -> None:
        """Waits for queued writes, then closes the backend."""
        self._writer.shutdown(wait=True)
        self._backend.close()
        if self._own_embedder:
            self.embedder.close()
