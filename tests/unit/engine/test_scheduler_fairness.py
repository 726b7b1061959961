"""Fair admission across tenants: round-robin among tenants with waiting work, on top of priority."""

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.scheduler import Scheduler

BS = 8


def make(max_num_seqs=1):
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=BS)
    return Scheduler(cfg, KVCacheManager(num_blocks=64, block_size=BS), max_model_len=64)


def req(rid, tenant, t, priority=0):
    return Request(
        rid, [1, 2, 3], SamplingParams(max_tokens=1), priority=priority, arrival_time=t, tenant=tenant
    )


def admit_all(s):
    """Admit one request per step (max_num_seqs=1), finishing it before the next step."""
    order = []
    while s.waiting:
        out = s.schedule()
        assert len(out.scheduled) == 1
        r = out.scheduled[0].request
        order.append(r.request_id)
        s.remove(r)
    return order


def test_one_tenants_backlog_does_not_starve_another():
    s = make()
    for i in range(5):
        s.add(req(f"a{i}", "alice", t=float(i)))
    s.add(req("b0", "bob", t=10.0))
    s.add(req("b1", "bob", t=11.0))
    s.add(req("c0", "carol", t=12.0))
    # FIFO would serve a0..a4 first; round-robin interleaves, each tenant in its own arrival order.
    assert admit_all(s) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]


def test_priority_comes_before_fairness():
    s = make()
    s.add(req("a0", "alice", 0.0))
    s.add(req("a1", "alice", 1.0))
    s.add(req("b0", "bob", 2.0, priority=5))  # lower priority (larger value)
    s.add(req("b1", "bob", 3.0, priority=-1))  # higher priority
    assert admit_all(s) == ["b1", "a0", "a1", "b0"]


def test_late_tenant_goes_next_in_a_running_batch():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"a{i}", "alice", float(i)))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a0", "a1"]
    s.add(req("b0", "bob", 9.0))
    s.remove(out.scheduled[0].request)  # a slot frees
    out = s.schedule()
    # a1 keeps running; the free slot goes to bob's request, not to alice's older a2.
    assert [x.request.request_id for x in out.scheduled] == ["a1", "b0"]


def test_single_tenant_keeps_fifo_and_queue_counts_stay_whole():
    s = make()
    for i in range(4):
        s.add(req(f"a{i}", "", float(i)))
    assert admit_all(s) == ["a0", "a1", "a2", "a3"]
    assert not s._waiting_tenants


def long_req(rid, tenant, t, priority=0):
    return Request(
        rid, [1, 2, 3], SamplingParams(max_tokens=100), priority=priority, arrival_time=t, tenant=tenant
    )


def running_ids(s):
    return sorted(r.request_id for r in s.running)


def test_a_tenant_holding_every_slot_yields_one_to_another_tenant():
    s = make(max_num_seqs=4)
    for i in range(6):
        s.add(long_req(f"a{i}", "alice", float(i)))
    s.schedule()
    assert running_ids(s) == ["a0", "a1", "a2", "a3"]
    s.schedule()  # alice alone: her running requests keep their slots
    assert running_ids(s) == ["a0", "a1", "a2", "a3"] and s.num_preemptions == 0
    s.add(long_req("b0", "bob", 10.0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["a3"]  # alice's newest running request
    assert "b0" in [x.request.request_id for x in out.scheduled]
    assert running_ids(s) == ["a0", "a1", "a2", "b0"]
    out = s.schedule()  # alice (3) is not below her share (2): nothing more is preempted
    assert out.preempted == [] and running_ids(s) == ["a0", "a1", "a2", "b0"]
    assert s.kv.num_free_blocks() == s.kv.num_blocks - 4  # the victim's block went back to the pool


def test_a_lower_priority_tenant_does_not_preempt():
    s = make(max_num_seqs=2)
    s.add(long_req("a0", "alice", 0.0))
    s.add(long_req("a1", "alice", 1.0))
    s.schedule()
    s.add(long_req("b0", "bob", 2.0, priority=5))
    out = s.schedule()
    assert out.preempted == [] and running_ids(s) == ["a0", "a1"]
