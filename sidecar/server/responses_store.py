"""Stored responses of the Responses API: bounded, per tenant, in memory.

A stored response keeps what a follow-up call with ``previous_response_id`` needs (the
conversation as chat messages, its input followed by its output) and the response object that
``GET /v1/responses/{id}`` returns. Each tenant has its own bounds and its own LRU order, so one
tenant filling its share never evicts another's responses, and lookups are keyed by (tenant, id):
a tenant never reads, and cannot learn of, another tenant's response.

Bounds, per tenant: at most ``max_entries`` responses and ``max_bytes`` of their JSON; the least
recently used go first. An entry older than ``ttl_s`` is gone (checked on access and swept on
insert). A single response larger than ``max_bytes`` is not stored (``put`` returns False).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as the API returned it
    messages: list[dict]  # the conversation up to and including this response, as chat messages
    size: int  # bytes of JSON both take, what the byte bound counts
    created: float  # monotonic seconds at insertion


def _size(response: dict, messages: list[dict]) -> int:
    return len(json.dumps([response, messages], separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


class _TenantStore:
    def __init__(self) -> None:
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest use first
        self.bytes = 0

    def drop(self, rid: str) -> bool:
        entry = self.entries.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True


class ResponseStore:
    """Thread-safe; every method is O(1) amortised except the TTL sweep on ``put``."""

    def __init__(
        self,
        max_entries: int = 1000,
        max_bytes: int = 64 * 1024 * 1024,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s <= 0:
            raise ValueError("ResponseStore: max_entries and max_bytes must be >= 0, ttl_s > 0")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._tenants: dict[str, _TenantStore] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def put(self, tenant: str, rid: str, response: dict, messages: list[dict]) -> bool:
        """Store (or replace) ``rid`` for ``tenant``, evicting that tenant's least recently used
        entries to stay within the bounds. False when the store is off or the entry alone is too big."""
        size = _size(response, messages)
        if not self.enabled or size > self.max_bytes:
            return False
        now = self._clock()
        with self._lock:
            ts = self._tenants.setdefault(tenant, _TenantStore())
            ts.drop(rid)
            self._sweep(ts, now)
            while ts.entries and (len(ts.entries) >= self.max_entries or ts.bytes + size > self.max_bytes):
                ts.drop(next(iter(ts.entries)))
            ts.entries[rid] = StoredResponse(response, messages, size, now)
            ts.bytes += size
            return True

    def get(self, tenant: str, rid: str) -> Optional[StoredResponse]:
        """The entry, marked most recently used; None when absent, expired or another tenant's."""
        with self._lock:
            ts = self._tenants.get(tenant)
            entry = ts.entries.get(rid) if ts is not None else None
            if entry is None:
                return None
            if self._clock() - entry.created >= self.ttl_s:
                ts.drop(rid)
                return None
            ts.entries.move_to_end(rid)
            return entry

    def delete(self, tenant: str, rid: str) -> bool:
        """Remove ``rid`` of ``tenant``; False when it was not there (or was another tenant's)."""
        with self._lock:
            ts = self._tenants.get(tenant)
            return ts is not None and self._live(ts, rid) and ts.drop(rid)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(entries, bytes) ``tenant`` holds now."""
        with self._lock:
            ts = self._tenants.get(tenant)
            if ts is None:
                return 0, 0
            self._sweep(ts, self._clock())
            return len(ts.entries), ts.bytes

    def _live(self, ts: _TenantStore, rid: str) -> bool:
        entry = ts.entries.get(rid)
        if entry is None:
            return False
        if self._clock() - entry.created >= self.ttl_s:
            ts.drop(rid)
            return False
        return True

    def _sweep(self, ts: _TenantStore, now: float) -> None:
        # A full pass: LRU order is not creation order once get() touches entries, and a tenant's
        # entries are bounded by max_entries.
        for rid in [r for r, e in ts.entries.items() if now - e.created >= self.ttl_s]:
            ts.drop(rid)
