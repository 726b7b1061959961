"""Scheduling of beam groups: a beam is preempted with its whole group, and beams waiting for siblings
that cannot get in make the newest group step back instead of holding the pool forever."""

from dataclasses import dataclass, field

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.request import Request, RequestStatus, SamplingParams
from sidecar.engine.scheduler import Scheduler

BS = 8


@dataclass
class Group:
    group_id: str
    beams: list = field(default_factory=list)


def beam(rid, group, t, n_tokens=16):
    r = Request(rid, list(range(3, 3 + n_tokens)), SamplingParams(max_tokens=4), arrival_time=t)
    r.beam_group = group
    group.beams.append(r)
    return r


def make(num_blocks):
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=BS)
    return Scheduler(cfg, KVCacheManager(num_blocks=num_blocks, block_size=BS), max_model_len=256)


def run_prefill(s, out):
    """The step's tokens computed; beams wait for their group with a row (as after sampling)."""
    for x in out.scheduled:
        x.request.num_computed_tokens += x.num_new_tokens
        x.request.beam_row = object()


def test_idle_beams_waiting_for_siblings_step_back():
    s = make(num_blocks=1 + 4)  # room for two 16-token beams
    a, b = Group("a"), Group("b")
    a0, b0 = beam("a0", a, 1.0), beam("b0", b, 2.0)
    s.add(a0)
    s.add(b0)
    run_prefill(s, s.schedule())  # both admitted: the pool is full
    assert {r.request_id for r in s.running} == {"a0", "b0"} and s.kv.num_free_blocks() == 0
    a1, b1 = beam("a1", a, 1.0), beam("b1", b, 2.0)  # each group's second beam cannot get in
    s.add(a1)
    s.add(b1)
    out = s.schedule()
    assert out.scheduled == [] and [r.request_id for r in out.preempted] == ["b0"]  # the newest group
    assert b0.status == RequestStatus.PREEMPTED and b0.beam_row is None and b0.num_computed_tokens == 0
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a1"]  # group a can now complete
    assert s.kv.num_free_blocks() == 0


def test_a_preempted_beam_takes_its_whole_group():
    s = make(num_blocks=1 + 6)
    g = Group("g")
    beams = [beam(f"g{i}", g, 1.0) for i in range(2)]
    other = Request("x", list(range(3, 19)), SamplingParams(max_tokens=8), arrival_time=0.5)
    for r in [other] + beams:
        s.add(r)
    out = s.schedule()
    assert len(out.scheduled) == 3 and s.kv.num_free_blocks() == 0
    for x in out.scheduled:
        x.request.num_computed_tokens += x.num_new_tokens
    other.append_token(5)  # the older request decodes into a new block: the tail group steps back
    for r in beams:
        r.append_token(7)
    out = s.schedule()
    assert sorted(r.request_id for r in out.preempted) == ["g0", "g1"]
    assert [x.request.request_id for x in out.scheduled] == ["x"]
    assert all(r.status == RequestStatus.PREEMPTED for r in beams) and s.running == [other]
