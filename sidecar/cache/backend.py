"""Where semantic-cache entries persist: the local SQLite file (default) or a shared Redis.

The in-memory tiers of ``SemanticCache`` (exact-key map, per-scope FAISS indexes) answer every
lookup; a backend only makes entries outlive the process and, for Redis, reach other replicas.
Writes reach it behind the response (``SemanticCache`` calls it from one writer thread, in order),
so a slow or failing backend never delays an answer.

Backend contract (called from worker threads, never from the event loop):
  ``load_all()``            entries to start with (stale ones are the caller's to drop)
  ``put(e)``                persist one entry, replacing any with the same exact key; may raise
  ``delete(entries)``       remove these entries (only if still the version given); may raise
  ``touch(e, when)``        record a hit for LRU order; best effort, returns False when skipped
  ``start(sink)``           begin delivering other replicas' changes to ``sink.apply_put(entry)`` /
                            ``sink.apply_delete(exact_key, created_at)`` (no-op for a local file)
  ``stats()``               counters of its own, merged into the cache's stats
  ``close()``
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from sidecar.cache.store import CacheStore, Entry
from sidecar.config import REDIS_PASSWORD_ENV


class SqliteBackend:
    """The local SQLite file at ``cache.path``."""

    def __init__(self, path: Any, embedding_model: str, dim: int) -> None:
        self.store = CacheStore(path, embedding_model, dim)

    def load_all(self) -> Iterable[Entry]:
        return self.store.load_all()

    def put(self, e: Entry) -> None:
        self.store.put(e)

    def delete(self, entries: list[Entry]) -> None:
        self.store.delete_versions([(e.exact_key, e.created_at) for e in entries])

    def touch(self, e: Entry, when: float) -> bool:
        return self.store.touch_key(e.exact_key, when)

    def start(self, sink: Any) -> None:
        pass

    def stats(self) -> dict:
        return {}

    @property
    def quarantined(self) -> int:
        return self.store.quarantined_rows

    def close(self) -> None:
        self.store.close()


class MemoryBackend:
    """No persistence (no ``cache.path``, no shared tier): the cache's in-memory tiers are all there is, so
    nothing keeps a second copy of every entry (an in-memory SQLite database did: about half of a
    memory-only cache's bytes)."""

    quarantined = 0

    def load_all(self) -> Iterable[Entry]:
        return ()

    def put(self, e: Entry) -> None:
        pass

    def delete(self, entries: list[Entry]) -> None:
        pass

    def touch(self, e: Entry, when: float) -> bool:
        return True

    def start(self, sink: Any) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def open_backend(cfg: Any, embedding_model: str, dim: int) -> Any:
    """The backend ``cfg.backend`` names (None: SQLite at ``cfg.path``, or memory only without a path);
    ``cfg`` is validated."""
    if not cfg.backend and not cfg.path:
        return MemoryBackend()
    if not cfg.backend:
        return SqliteBackend(cfg.path, embedding_model, dim)
    from sidecar.cache.redis_store import RedisBackend

    return RedisBackend(
        cfg.backend,
        embedding_model,
        dim,
        ttl_s=cfg.ttl_s,
        max_entries=cfg.max_entries,
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,
    )
