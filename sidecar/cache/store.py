"""SQLite persistence for semantic-cache entries (vectors included).

Crash safety: the database runs in WAL mode and every mutation is one
transaction, so a process killed at any instant (SIGKILL included) leaves the
file at the last committed transaction: at most the entry being written is
lost, never the store. ``synchronous=NORMAL`` is enough for that: a WAL commit
is durable against process death (the OS holds the pages); only a power loss
can drop the newest commits, and even then never corrupts the file.

``path=None`` keeps everything in an in-memory database through the same code.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    -- AUTOINCREMENT: ids are never reused, so a deleted entry's id cannot come back as another entry.
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    exact_key TEXT NOT NULL UNIQUE,
    scope_key TEXT NOT NULL,
    query TEXT NOT NULL,
    text TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    vector BLOB NOT NULL,
    created_at REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass
class Entry:
    id: int
    exact_key: str
    scope_key: str
    query: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    vector: np.ndarray
    created_at: float
    last_access: float


class CacheStore:
    """Entries table; each public method is one transaction; safe to call from several threads."""

    def __init__(self, path: Optional[str], embedding_model: str, dim: int):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
            if path:
                mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise ValueError(f"cache.path: cannot enable WAL journaling on {path!r} (got {mode})")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"cache.path: cannot open {path!r} as a cache database: {exc}") from None
        self._check_model(embedding_model, dim)

    def _check_model(self, embedding_model: str, dim: int) -> None:
        """Vectors from another embedding model are meaningless here: drop them rather than mix."""
        want = json.dumps({"embedding_model": embedding_model, "dim": dim})
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='embedding'").fetchone()
            if row is not None and row[0] == want:
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if row is not None:
                    self._db.execute("DELETE FROM entries")
                self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('embedding', ?)", (want,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def load_all(self) -> Iterator[Entry]:
        """All entries, least recently used first (the order the in-memory LRU is rebuilt in)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, exact_key, scope_key, query, text, token_ids, finish_reason, prompt_tokens,"
                " completion_tokens, vector, created_at, last_access FROM entries ORDER BY last_access, id"
            ).fetchall()
        for r in rows:
            yield Entry(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), r[6], r[7], r[8],
                        np.frombuffer(r[9], dtype=np.float32).copy(), r[10], r[11])

    def put(self, e: Entry) -> int:
        """Insert ``e`` (replacing the row with the same exact key) in one transaction; return its id."""
        vec = np.ascontiguousarray(e.vector, dtype=np.float32).tobytes()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM entries WHERE exact_key=?", (e.exact_key,))
                cur = self._db.execute(
                    "INSERT INTO entries(exact_key, scope_key, query, text, token_ids, finish_reason,"
                    " prompt_tokens, completion_tokens, vector, created_at, last_access)"
                    " VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                    (e.exact_key, e.scope_key, e.query, e.text, json.dumps(e.token_ids), e.finish_reason,
                     e.prompt_tokens, e.completion_tokens, vec, e.created_at, e.last_access))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return int(cur.lastrowid)

    def delete(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("DELETE FROM entries WHERE id=?", [(i,) for i in ids])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def touch(self, entry_id: int, when: float) -> bool:
        """Record a hit for LRU order across restarts (single autocommitted UPDATE)."""
        with self._lock:
            self._db.execute("UPDATE entries SET last_access=? WHERE id=?", (when, entry_id))
        return True

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
