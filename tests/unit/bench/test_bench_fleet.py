"""Routing and aggregation of ``sidecar bench fleet`` (no servers: replicas are simulated prefix caches)."""

from __future__ import annotations

import pytest

from sidecar.bench.fleet import (
    HashRing,
    RoundRobin,
    TurnRecord,
    conversations,
    router,
    ring_hash,
    run_routing,
    summarise,
)


def test_ring_hash_equals_the_java_balancers_hash():
    # Values printed by SessionAffinityLoadBalancer.hash (Java) for the same strings.
    assert ring_hash("") == -780787492076525413
    assert ring_hash("conversation-7") == -4034858949859192551
    assert ring_hash("[/127.0.0.1:50051]#0") == -2727775016092218701
    assert ring_hash("sessión-ü") == -3731238892973672614


def test_ring_sends_a_key_always_to_one_replica_and_spreads_keys():
    names = ["127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"]
    ring = HashRing(names)
    keys = [f"session-{i}" for i in range(3000)]
    owners = [ring.pick(k) for k in keys]
    assert owners == [HashRing(names).pick(k) for k in keys]  # a fresh ring over the same replicas agrees
    for i in range(3):
        assert 0.2 < owners.count(i) / len(keys) < 0.47


def test_removing_a_replica_moves_only_its_keys():
    names = ["a:1", "b:2", "c:3", "d:4"]
    before = HashRing(names)
    after = HashRing([n for n in names if n != "c:3"])
    keys = [f"conversation-{i}" for i in range(2000)]
    moved = 0
    for k in keys:
        old = names[before.pick(k)]
        new = [n for n in names if n != "c:3"][after.pick(k)]
        if old != "c:3":
            assert new == old, k
        else:
            moved += 1
    assert 0.1 < moved / len(keys) < 0.4


def test_round_robin_cycles_whatever_the_key():
    rr = RoundRobin(3)
    assert [rr.pick("same") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_unknown_routing_is_refused_by_name():
    with pytest.raises(ValueError, match="routing"):
        router("random", ["a"])


def test_summarise_counts_shares_and_stickiness():
    rows = [
        TurnRecord("c0", 0, 0, 100, 0),
        TurnRecord("c0", 1, 0, 200, 96),
        TurnRecord("c0", 2, 1, 300, 0),
        TurnRecord("c1", 0, 1, 100, 0),
        TurnRecord("c1", 1, 1, 200, 96),
    ]
    s = summarise(rows)
    assert s["prompt_tokens"] == 900 and s["cached_tokens"] == 192
    assert s["cached_share"] == pytest.approx(192 / 900)
    assert s["cached_share_after_first_turn"] == pytest.approx(192 / 700)
    assert s["same_replica_as_previous_turn"] == pytest.approx(2 / 3)
    assert s["calls_per_replica"] == {0: 2, 1: 3}


class _Replicas:
    """Each replica caches every prompt it computed; a prompt's cached part is its longest prefix of whole
    messages (10 tokens each) that this replica computed before."""

    def __init__(self, n: int) -> None:
        self.seen = [set() for _ in range(n)]

    def call(self, replica: int, messages: list[dict]) -> tuple:
        key = tuple((m["role"], m["content"]) for m in messages)
        cached = max((k for k in range(len(key)) if key[:k] in self.seen[replica]), default=0)
        for k in range(1, len(key) + 2):  # the answer is computed too: prompt + answer are cached
            self.seen[replica].add((key + (("assistant", f"answer {len(key)}"),))[:k])
        return f"answer {len(key)}", 10 * len(key), 10 * cached, 1.0


def test_affinity_keeps_what_one_replica_reuses_and_round_robin_loses_it():
    scripts = conversations(9, 4, 5, 3, seed=1)
    shares = {}
    for mode in ("one", "affinity", "round-robin"):
        sim = _Replicas(3)
        rows = run_routing(mode, scripts, ["a:1", "b:2", "c:3"], sim.call, concurrency=1)
        assert len(rows) == 9 * 4
        s = summarise(rows)
        shares[mode] = s["cached_share_after_first_turn"]
        if mode == "affinity":
            assert s["same_replica_as_previous_turn"] == 1.0
            assert len(s["calls_per_replica"]) > 1  # sessions are spread over the replicas
        if mode == "round-robin":
            assert s["same_replica_as_previous_turn"] == 0.0  # 4 turns, 3 replicas, one call at a time
    assert shares["affinity"] == pytest.approx(shares["one"])
    assert shares["round-robin"] < 0.5 * shares["one"]
