"""The semantic cache's SQLite file: a locked, full or damaged file never stalls or stops the sidecar."""

import asyncio
import sqlite3
import time

import numpy as np

from sidecar.cache.semantic import CacheScope, SemanticCache
from sidecar.cache.store import CacheStore, Entry
from sidecar.config import CacheConfig
from test_cache_crash import HashEmbedder  # the same deterministic stand-in the crash test's writers use


def _scope(q):
    return CacheScope(tenant="t", model="m", settings="s", context="", query=q)


def _fill(path, n=40):
    cache = SemanticCache(CacheConfig(path=str(path)), embedder=HashEmbedder())
    for i in range(n):
        asyncio.run(
            cache.store(_scope(f"question number {i} " + "pad " * 30), f"answer {i}", [1, 2, i], "stop", 3, 3)
        )
    cache.close()


def test_bad_rows_are_dropped_and_counted(tmp_path):
    path = tmp_path / "c.db"
    _fill(path, 5)
    db = sqlite3.connect(path)
    db.execute("UPDATE entries SET token_ids='[1, 2' WHERE id=1")  # invalid JSON
    db.execute("UPDATE entries SET text=CAST(x'fffe41' AS TEXT) WHERE id=2")  # invalid UTF-8
    db.execute("UPDATE entries SET vector=x'0102' WHERE id=3")  # truncated vector
    db.commit()
    db.close()
    cache = SemanticCache(CacheConfig(path=str(path)), embedder=HashEmbedder())
    try:
        assert cache.stats()["entries"] == 2
        assert cache.stats()["quarantined"] == 3
        assert asyncio.run(cache.lookup(_scope("question number 4 " + "pad " * 30))).text == "answer 4"
    finally:
        cache.close()
    assert CacheStore(str(path), "hash-embedder", 32).count() == 2  # dropped from the file too


def test_damaged_pages_move_the_file_aside(tmp_path):
    path = tmp_path / "c.db"
    _fill(path, 40)
    raw = bytearray(path.read_bytes())
    page = 4096
    assert len(raw) > 4 * page
    raw[2 * page : 3 * page] = b"\xa5" * page  # garbage over a b-tree page
    path.write_bytes(bytes(raw))
    cache = SemanticCache(CacheConfig(path=str(path)), embedder=HashEmbedder())
    try:
        assert cache.stats()["entries"] == 0
        moved = cache._store.quarantined_file
        assert moved and (tmp_path / moved.split("/")[-1]).exists()
        asyncio.run(cache.store(_scope("a fresh question"), "a fresh answer", [5], "stop", 1, 1))
        assert asyncio.run(cache.lookup(_scope("a fresh question"))).text == "a fresh answer"
    finally:
        cache.close()


def test_locked_file_fails_writes_fast_and_hits_still_answer(tmp_path):
    path = tmp_path / "c.db"
    cache = SemanticCache(CacheConfig(path=str(path)), embedder=HashEmbedder())
    asyncio.run(cache.store(_scope("held question"), "held answer", [1], "stop", 1, 1))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        t0 = time.monotonic()
        hit = asyncio.run(cache.lookup(_scope("held question")))
        assert hit is not None and hit.text == "held answer"  # the hit is served; only its touch is skipped
        try:
            asyncio.run(cache.store(_scope("new question"), "new answer", [2], "stop", 1, 1))
            raise AssertionError("a store into a locked file must fail")
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc)
        # Liveness: both give up after the short busy timeout; the old 5 s timeout per call would
        # take 10 s here.
        assert time.monotonic() - t0 < 4.0
        stats = cache.stats()
        assert stats["store_busy"] == 1 and stats["store_failed"] == 1
    finally:
        other.execute("ROLLBACK")
        other.close()
        cache.close()


def test_disk_full_reports_the_real_error(tmp_path):
    st = CacheStore(str(tmp_path / "c.db"), "hash-embedder", 32)
    st._db.execute("PRAGMA max_page_count=" + str(st._db.execute("PRAGMA page_count").fetchone()[0]))
    e = Entry(0, "k", "s", "q", "x" * 100_000, [1], "stop", 1, 1, np.zeros(32, np.float32), 0.0, 0.0)
    try:
        st.put(e)
        raise AssertionError("put must fail on a full database")
    except sqlite3.Error as exc:
        assert "full" in str(exc) and "rollback" not in str(exc)
    finally:
        st.close()
