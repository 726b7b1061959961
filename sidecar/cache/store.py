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
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

log = logging.getLogger("sidecar.cache")

# Another process holding the file's lock must never stall a request: writes wait this long at
# most, then fail (the answer is not cached); hits skip their LRU touch.
BUSY_TIMEOUT_MS = 200

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
        self.quarantined_rows = 0
        self.quarantined_file: Optional[str] = None
        try:
            self._open()
        except sqlite3.DatabaseError as exc:
            # Only a damaged SQLite file is moved aside; anything else at that path (a wrong path to
            # someone's data) is a configuration error and is left untouched.
            if not path or not _is_sqlite_file(path) or _is_busy(exc):
                raise ValueError(f"cache.path: cannot open {path!r} as a cache database: {exc}") from None
            self._quarantine_file(str(exc))
            try:
                self._open()
            except sqlite3.DatabaseError as exc2:
                raise ValueError(f"cache.path: cannot open {path!r} as a cache database: {exc2}") from None
        self._check_model(embedding_model, dim)

    def _open(self) -> None:
        path = self.path
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        try:
            if path:
                mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise ValueError(f"cache.path: cannot enable WAL journaling on {path!r} (got {mode})")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._db.executescript(_SCHEMA)
            if path:
                # A damaged page anywhere (not only in the rows read at start) is found now, not at
                # some later write.
                problem = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
                if problem != "ok":
                    raise sqlite3.DatabaseError(f"integrity check failed: {problem}")
        except BaseException:
            self._db.close()
            raise

    def _quarantine_file(self, reason: str) -> None:
        """Move a damaged database (and its WAL) aside, keeping it for inspection, and start empty."""
        moved = f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, moved + suffix)
        self.quarantined_file = moved
        log.error(
            "semantic cache file %s is damaged (%s); moved it to %s and starting empty",
            self.path,
            reason,
            moved,
        )

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
                self._rollback()
                raise

    def load_all(self) -> Iterator[Entry]:
        """All readable entries, least recently used first (the order the in-memory LRU is rebuilt in).

        A row that cannot be decoded (invalid UTF-8, malformed token ids or vector) is deleted and
        counted in ``quarantined_rows``; a file whose pages cannot be read is moved aside and the
        store continues empty. Either way the sidecar serves.
        """
        try:
            rows = self._read_rows()
        except sqlite3.DatabaseError as exc:
            if not self.path or _is_busy(exc):
                raise
            with self._lock:
                self._db.close()
                self._quarantine_file(str(exc))
                self._open()
            rows = []
        bad = []
        for r in rows:
            try:
                e = _decode_row(r)
            except (ValueError, TypeError) as exc:
                bad.append(r[0])
                log.warning("semantic cache row %s is damaged (%s); dropped", r[0], exc)
                continue
            yield e
        if bad:
            self.quarantined_rows += len(bad)
            self.delete(bad)

    def _read_rows(self) -> list:
        with self._lock:
            # Text columns come back as bytes and are decoded per row, so one row with invalid
            # UTF-8 is dropped instead of failing the whole read.
            self._db.text_factory = bytes
            try:
                return self._db.execute(
                    "SELECT id, exact_key, scope_key, query, text, token_ids, finish_reason, prompt_tokens,"
                    " completion_tokens, vector, created_at, last_access FROM entries ORDER BY last_access, id"
                ).fetchall()
            finally:
                self._db.text_factory = str

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
                    (
                        e.exact_key,
                        e.scope_key,
                        e.query,
                        e.text,
                        json.dumps(e.token_ids),
                        e.finish_reason,
                        e.prompt_tokens,
                        e.completion_tokens,
                        vec,
                        e.created_at,
                        e.last_access,
                    ),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
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
                self._rollback()
                raise

    def delete_versions(self, versions: list[tuple[str, float]]) -> None:
        """Delete rows by (exact key, created_at): a row replaced since (newer created_at) stays."""
        if not versions:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("DELETE FROM entries WHERE exact_key=? AND created_at=?", versions)
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def touch_key(self, exact_key: str, when: float) -> bool:
        """``touch`` by exact key (in-memory ids are not the file's row ids)."""
        try:
            with self._lock:
                self._db.execute("UPDATE entries SET last_access=? WHERE exact_key=?", (when, exact_key))
            return True
        except sqlite3.Error as exc:
            log.debug("semantic cache touch skipped: %s", exc)
            return False

    def _rollback(self) -> None:
        # SQLite rolls back by itself on some errors (disk full, I/O); a second ROLLBACK would then
        # fail with "cannot rollback" and hide the real error.
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                log.debug("rollback failed", exc_info=True)

    def touch(self, entry_id: int, when: float) -> bool:
        """Record a hit for LRU order across restarts (single autocommitted UPDATE).

        Best effort: False when the file is busy or failing; only the persisted LRU order suffers."""
        try:
            with self._lock:
                self._db.execute("UPDATE entries SET last_access=? WHERE id=?", (when, entry_id))
            return True
        except sqlite3.Error as exc:
            log.debug("semantic cache touch skipped: %s", exc)
            return False

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _is_sqlite_file(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _is_busy(exc: sqlite3.Error) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def _text(v: object) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if not isinstance(v, str):
        raise TypeError(f"expected text, got {type(v).__name__}")
    return v


def _decode_row(r: tuple) -> Entry:
    ids = json.loads(_text(r[5]))
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("token_ids is not a list of integers")
    if not isinstance(r[9], bytes) or len(r[9]) % 4:
        raise ValueError("vector is not float32 data")
    return Entry(
        r[0],
        _text(r[1]),
        _text(r[2]),
        _text(r[3]),
        _text(r[4]),
        ids,
        _text(r[6]),
        int(r[7]),
        int(r[8]),
        np.frombuffer(r[9], dtype=np.float32).copy(),
        float(r[10]),
        float(r[11]),
    )
