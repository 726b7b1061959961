"""ResponseStore: per-tenant bounds (entries, bytes), TTL, LRU order, and tenant isolation."""

from __future__ import annotations

import pytest

from sidecar.server.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def resp(rid: str, pad: int = 0) -> dict:
    return {"id": rid, "object": "response", "output": [{"text": "x" * pad}]}


MSGS = [{"role": "user", "content": "hi"}]


def test_a_tenant_never_reads_or_deletes_another_tenants_response():
    s = ResponseStore()
    assert s.put("a", "r1", resp("r1"), MSGS)
    assert s.get("b", "r1") is None and s.get("", "r1") is None
    assert not s.delete("b", "r1")
    assert s.get("a", "r1").response["id"] == "r1" and s.get("a", "r1").messages == MSGS
    assert s.delete("a", "r1") and s.get("a", "r1") is None and not s.delete("a", "r1")


def test_same_id_in_two_tenants_are_two_entries():
    s = ResponseStore()
    s.put("a", "r", resp("r", 1), MSGS)
    s.put("b", "r", resp("r", 2), MSGS)
    assert s.get("a", "r").response["output"][0]["text"] == "x"
    assert s.get("b", "r").response["output"][0]["text"] == "xx"


def test_entry_bound_evicts_least_recently_used_of_that_tenant_only():
    s = ResponseStore(max_entries=3)
    for r in ("r1", "r2", "r3"):
        s.put("a", r, resp(r), MSGS)
    s.put("b", "other", resp("other"), MSGS)
    assert s.get("a", "r1") is not None  # r1 is now the most recently used; r2 the least
    s.put("a", "r4", resp("r4"), MSGS)
    assert s.get("a", "r2") is None
    assert [r for r in ("r1", "r3", "r4") if s.get("a", r)] == ["r1", "r3", "r4"]
    assert s.get("b", "other") is not None and s.usage("a")[0] == 3 and s.usage("b")[0] == 1


def test_byte_bound_counts_json_and_evicts_until_the_new_entry_fits():
    size = ResponseStore()
    size.put("t", "r0", resp("r0", 100), MSGS)
    entry_bytes = size.usage("t")[1]
    s = ResponseStore(max_bytes=2 * entry_bytes + entry_bytes // 2)
    for r in ("r0", "r1", "r2"):
        s.put("t", r, resp("r0", 100), MSGS)
    assert s.usage("t") == (2, 2 * entry_bytes)
    assert s.get("t", "r0") is None and s.get("t", "r1") and s.get("t", "r2")
    assert not s.put("t", "huge", resp("huge", 10 * entry_bytes), MSGS)  # alone over the bound: not stored
    assert s.get("t", "huge") is None and s.usage("t") == (2, 2 * entry_bytes)


def test_replacing_an_id_does_not_double_count():
    s = ResponseStore()
    s.put("t", "r", resp("r", 10), MSGS)
    before = s.usage("t")
    s.put("t", "r", resp("r", 10), MSGS)
    assert s.usage("t") == before


def test_ttl_expires_on_access_and_on_insert():
    clock = Clock()
    s = ResponseStore(ttl_s=10.0, clock=clock)
    s.put("t", "old", resp("old"), MSGS)
    clock.t = 5.0
    s.put("t", "new", resp("new"), MSGS)
    clock.t = 10.0
    assert s.get("t", "old") is None and s.get("t", "new") is not None
    s.put("t", "old2", resp("old2"), MSGS)
    clock.t = 15.0
    assert s.usage("t")[0] == 1  # "new" (created at 5) expired, "old2" (at 10) is live
    assert not s.delete("t", "new")


def test_zero_bounds_store_nothing_and_bad_bounds_are_refused():
    s = ResponseStore(max_entries=0)
    assert not s.enabled and not s.put("t", "r", resp("r"), MSGS) and s.get("t", "r") is None
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=-1)
