"""kill -9 while the cache writes: the SQLite store reopens intact and serves.

A child process stores entries as fast as it can (large answers, so a kill often
lands inside a transaction) and is killed with SIGKILL at a random moment. The
reopened cache must pass SQLite's integrity check, hold every entry committed
before the kill (at most the one in flight is lost), serve them, and accept writes.
"""

import asyncio
import os
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from sidecar.cache.semantic import CacheScope, SemanticCache
from sidecar.config import CacheConfig

ROOT = pathlib.Path(__file__).resolve().parents[3]

FAKE_EMBEDDER = textwrap.dedent('''
    import hashlib
    import numpy as np

    class HashEmbedder:
        """Deterministic stand-in for the sentence model: the store does not care what vectors mean."""
        model_name = "hash-embedder"
        dim = 32

        def embed(self, texts):
            out = []
            for t in texts:
                seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
                v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
                out.append(v / np.linalg.norm(v))
            return np.stack(out)

        async def aembed(self, texts):
            return self.embed(texts)

        def close(self):
            pass
''')

WRITER = FAKE_EMBEDDER + textwrap.dedent("""
    import asyncio, sys
    from sidecar.cache.semantic import CacheScope, SemanticCache
    from sidecar.config import CacheConfig

    async def main(path, start):
        cache = SemanticCache(CacheConfig(path=path, max_entries=100000), embedder=HashEmbedder())
        big = "x" * 200_000
        i = start
        while True:
            await cache.store(CacheScope("t", "m", "s", "", f"question {i}"), f"answer {i} " + big,
                              list(range(64)), "stop", 5, 64)
            i += 1

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")

namespace: dict = {}
exec(FAKE_EMBEDDER, namespace)
HashEmbedder = namespace["HashEmbedder"]


def committed_rows(path):
    con = sqlite3.connect(path, timeout=5)
    try:
        return con.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    except sqlite3.OperationalError:  # table not created yet
        return 0
    finally:
        con.close()


def test_sigkill_during_writes_never_corrupts_the_store(tmp_path):
    path = str(tmp_path / "cache.db")
    rng = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = 0
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, path, str(start)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while committed_rows(path) < start + 5:
                assert child.poll() is None, child.stderr.read().decode()
                assert time.monotonic() < deadline, "writer made no progress"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.3))
            seen = committed_rows(path)  # committed before the kill: must all survive
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stderr.close()
        assert child.returncode == -signal.SIGKILL

        con = sqlite3.connect(path)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        con.close()
        cache = SemanticCache(CacheConfig(path=path, max_entries=100000), embedder=HashEmbedder())
        try:
            n = cache.stats()["entries"]
            assert n >= seen
            last = max(int(q.split()[1]) for q in _queries(path))
            assert n == last + 1  # the ids written so far, without holes: nothing but the tail is lost
            for i in (0, last // 2, last):
                hit = asyncio.run(cache.lookup(CacheScope("t", "m", "s", "", f"question {i}")))
                assert hit is not None and hit.text.startswith(f"answer {i} ") and hit.kind == "exact"
            asyncio.run(cache.store(CacheScope("t", "m", "s", "", "after crash"), "fine", [1], "stop", 1, 1))
            assert asyncio.run(cache.lookup(CacheScope("t", "m", "s", "", "after crash"))).text == "fine"
        finally:
            cache.close()
        start = last + 1
        # The probe entry is not part of the numbered sequence.
        con = sqlite3.connect(path)
        con.execute("DELETE FROM entries WHERE query='after crash'")
        con.commit()
        con.close()


def _queries(path):
    con = sqlite3.connect(path)
    try:
        return [r[0] for r in con.execute("SELECT query FROM entries")]
    finally:
        con.close()
