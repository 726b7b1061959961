"""Shared semantic-cache tier on plain Redis (>= 6) or Valkey; no vector search module needed.

Layout under one namespace per embedding model (replicas with different embedders never mix):
  ``<ns>e:<exact key>``  one entry (answer, scope key, normalised query, token ids, embedding, created),
                         JSON; its TTL is the key's expiry
  ``<ns>log``            a Stream of changes: ``put`` (with the entry) and ``del`` (exact key, created)

Each replica keeps the in-memory tiers (exact map, FAISS per scope) as a local mirror: loaded from the
entry keys at start, then kept current by a follower thread reading the stream, so what one replica
stores another serves within one stream round trip.

Failure model: Redis down or slow never fails or delays a request. Calls run in the cache's writer
thread or the follower thread, each with short socket timeouts. While Redis is unreachable, puts are
kept (bounded) and the follower reconnects with exponential backoff; once back it re-sends the kept
puts and resyncs the mirror from the entry keys. Deletes made during an outage are not kept: the
entries they would remove expire by TTL. An entry that cannot be decoded, is too large, or
has the wrong vector size is skipped and counted in ``malformed``.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from typing import Any, Iterable, Optional

import numpy as np

from sidecar.cache.store import Entry

log = logging.getLogger("sidecar.cache.redis")

MAX_ENTRY_BYTES = 512 * 1024  # larger entries are neither written nor read
_PENDING_MAX = 2000  # puts kept while Redis is unreachable; the oldest go first
_SOCKET_TIMEOUT_S = 0.5
_BLOCK_MS = 500  # stream read wait; the follower's socket timeout is above it
_BACKOFF_S = (0.05, 5.0)
_SCAN_BATCH = 500


def encode_entry(e: Entry) -> bytes:
    vec = np.ascontiguousarray(e.vector, dtype=np.float32).tobytes()
    return json.dumps(
        {
            "k": e.exact_key,
            "s": e.scope_key,
            "q": e.query,
            "t": e.text,
            "ids": e.token_ids,
            "f": e.finish_reason,
            "pt": e.prompt_tokens,
            "ct": e.completion_tokens,
            "c": e.created_at,
            "v": base64.b64encode(vec).decode(),
        },
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode()


def decode_entry(raw: Any, dim: int) -> Entry:
    """The entry in ``raw``; ValueError/TypeError/KeyError for anything malformed."""
    if not isinstance(raw, (bytes, str)) or len(raw) > MAX_ENTRY_BYTES:
        raise ValueError("missing or oversized entry")
    d = json.loads(raw)
    ids = d["ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("token ids are not integers")
    vec = np.frombuffer(base64.b64decode(d["v"], validate=True), dtype=np.float32).copy()
    if vec.shape != (dim,) or not np.all(np.isfinite(vec)):
        raise ValueError(f"vector has {vec.size} values, expected {dim}")
    strs = [d[k] for k in ("k", "s", "q", "t", "f")]
    if not all(isinstance(x, str) for x in strs):
        raise TypeError("text field is not a string")
    created = float(d["c"])
    return Entry(
        0, strs[0], strs[1], strs[2], strs[3], ids, strs[4], int(d["pt"]), int(d["ct"]), vec, created, created
    )


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisBackend:
    """See the module docstring; the backend contract is in ``sidecar.cache.backend``."""

    def __init__(
        self,
        url: str,
        embedding_model: str,
        dim: int,
        ttl_s: float,
        max_entries: int,
        password: Optional[str] = None,
    ) -> None:
        import redis

        self._redis = redis
        self.dim, self.ttl_s = dim, ttl_s
        ns = hashlib.sha256(f"{embedding_model}:{dim}".encode()).hexdigest()[:12]
        self.ns = f"sidecar:cache:{ns}:"
        self.stream = self.ns + "log"
        self.stream_max = max(1000, 2 * max_entries)
        self.replica = uuid.uuid4().hex[:12]
        kw = dict(password=password, socket_connect_timeout=_SOCKET_TIMEOUT_S, health_check_interval=0)
        self._client = redis.Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S, **kw)
        self._follow_client = redis.Redis.from_url(url, socket_timeout=_BLOCK_MS / 1000 + 2.0, **kw)
        self._lock = threading.Lock()  # guards the counters, _pending and _up
        self._pending: "collections.OrderedDict[str, Entry]" = collections.OrderedDict()
        self._up = False
        self._last_id = "0-0"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sink: Any = None
        self.counters = dict(
            malformed=0, backend_errors=0, remote_puts=0, remote_deletes=0, resyncs=0, oversized=0
        )

    # -- contract ---------------------------------------------------------------
    def load_all(self) -> Iterable[Entry]:
        """Every readable entry now in Redis; [] if Redis is unreachable (the follower resyncs later)."""
        try:
            self._last_id = self._stream_tail()
            entries = self._scan()
        except self._redis.RedisError as exc:
            log.warning("semantic cache: Redis unreachable at start (%s); serving from local tiers", exc)
            self._count("backend_errors")
            return []
        self._set_up(True)
        return entries

    def put(self, e: Entry) -> None:
        raw = encode_entry(e)
        if len(raw) > MAX_ENTRY_BYTES:
            self._count("oversized")
            return
        with self._lock:
            up = self._up
            if not up:
                self._keep(e)
        if not up:
            return
        try:
            self._write(e, raw)
        except self._redis.RedisError as exc:
            log.warning("semantic cache: Redis write failed (%s); keeping the entry until it is back", exc)
            self._count("backend_errors")
            with self._lock:
                self._keep(e)
            self._set_up(False)

    def delete(self, entries: list[Entry]) -> None:
        if not entries or not self._up:
            return
        try:
            p = self._client.pipeline(transaction=True)
            for e in entries:
                p.delete(self.ns + "e:" + e.exact_key)
                p.xadd(
                    self.stream,
                    {"op": "del", "src": self.replica, "k": e.exact_key, "c": repr(e.created_at)},
                    maxlen=self.stream_max,
                    approximate=True,
                )
            p.execute()
        except self._redis.RedisError as exc:
            self._count("backend_errors")
            self._set_up(False)
            log.warning("semantic cache: Redis delete failed (%s)", exc)

    def touch(self, e: Entry, when: float) -> bool:
        return True  # expiry is by age; hit order stays per replica

    def start(self, sink: Any) -> None:
        self._sink = sink
        self._thread = threading.Thread(target=self._follow, name="sidecar-cache-redis", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            out["backend_up"] = int(self._up)
            out["backend_pending"] = len(self._pending)
        return out

    @property
    def quarantined(self) -> int:
        return 0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_BLOCK_MS / 1000 + 3.0)
        for c in (self._client, self._follow_client):
            try:
                c.close()
            except Exception:  # closing a dead connection may raise; nothing is left to release
                pass

    # -- internals --------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _set_up(self, up: bool) -> None:
        with self._lock:
            self._up = up

    def _keep(self, e: Entry) -> None:  # caller holds _lock
        self._pending[e.exact_key] = e
        self._pending.move_to_end(e.exact_key)
        while len(self._pending) > _PENDING_MAX:
            self._pending.popitem(last=False)

    def _write(self, e: Entry, raw: bytes) -> None:
        left = self.ttl_s - (time.time() - e.created_at)
        if left <= 0:
            return
        p = self._client.pipeline(transaction=True)
        p.set(self.ns + "e:" + e.exact_key, raw, ex=max(1, math.ceil(left)))
        p.xadd(
            self.stream,
            {"op": "put", "src": self.replica, "k": e.exact_key, "e": raw},
            maxlen=self.stream_max,
            approximate=True,
        )
        p.execute()

    def _stream_tail(self) -> str:
        last = self._client.xrevrange(self.stream, count=1)
        return _str(last[0][0]) if last else "0-0"

    def _scan(self) -> list[Entry]:
        out = []
        keys = []
        for k in self._client.scan_iter(match=self.ns + "e:*", count=_SCAN_BATCH):
            keys.append(k)
            if len(keys) >= _SCAN_BATCH:
                out += self._read(keys)
                keys = []
        if keys:
            out += self._read(keys)
        return out

    def _read(self, keys: list) -> list[Entry]:
        out = []
        for k, raw in zip(keys, self._client.mget(keys)):
            if raw is None:  # expired between SCAN and MGET
                continue
            e = self._decode(raw, _str(k))
            if e is not None:
                out.append(e)
        return out

    def _decode(self, raw: Any, where: str) -> Optional[Entry]:
        try:
            return decode_entry(raw, self.dim)
        except (ValueError, TypeError, KeyError) as exc:
            self._count("malformed")
            log.warning("semantic cache: skipped a malformed Redis entry (%s): %s", where, exc)
            return None

    def _follow(self) -> None:
        """Follower thread: apply other replicas' changes; on errors reconnect with backoff and resync."""
        delay = _BACKOFF_S[0]
        need_resync = not self._up
        while not self._stop.is_set():
            try:
                if need_resync:
                    self._resync()
                    need_resync = False
                    delay = _BACKOFF_S[0]
                resp = self._follow_client.xread({self.stream: self._last_id}, count=200, block=_BLOCK_MS)
                for _name, msgs in resp or []:
                    for mid, fields in msgs:
                        self._last_id = _str(mid)
                        self._apply(fields)
                if not self._up:  # a write failed meanwhile: the stream works, so resync and re-send
                    need_resync = True
            except self._redis.RedisError as exc:
                if self._up:
                    log.warning(
                        "semantic cache: lost Redis (%s); serving from local tiers, reconnecting", exc
                    )
                self._count("backend_errors")
                self._set_up(False)
                need_resync = True
                self._stop.wait(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
            except Exception:  # a bug in applying one message must not end the mirror for good
                log.exception("semantic cache: Redis follower error")
                self._stop.wait(delay)

    def _resync(self) -> None:
        """Back after an outage (or a start without Redis): re-send kept puts, reload the mirror."""
        self._follow_client.ping()
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for i, e in enumerate(pending):
            try:
                self._write(e, encode_entry(e))
            except self._redis.RedisError:
                with self._lock:  # lost again: keep what was not sent, newest last
                    for rest in pending[i:]:
                        if rest.exact_key not in self._pending:
                            self._keep(rest)
                raise
        tail = self._stream_tail()
        for e in self._scan():
            self._sink.apply_put(e)
        self._last_id = tail
        self._set_up(True)
        self._count("resyncs")
        log.info("semantic cache: Redis reachable; re-sent %d entries and resynced", len(pending))

    def _apply(self, fields: dict) -> None:
        f = {_str(k): v for k, v in fields.items()}
        if _str(f.get("src", b"")) == self.replica:
            return  # our own change is in memory already
        op = _str(f.get("op", b""))
        if op == "put":
            e = self._decode(f.get("e"), "stream")
            if e is not None:
                self._count("remote_puts")
                self._sink.apply_put(e)
        elif op == "del":
            try:
                key, created = _str(f["k"]), float(_str(f["c"]))
            except (KeyError, ValueError):
                self._count("malformed")
                return
            self._count("remote_deletes")
            self._sink.apply_delete(key, created)
        else:
            self._count("malformed")
