"""Token-budget scheduler (one rule for prefill, chunked prefill, decode and prefix hits).

Each step has ``max_num_batched_tokens`` to give. Running requests are served
first, then waiting ones, each getting ``min(tokens it still needs, budget
left)``. A request needs ``num_tokens - num_computed_tokens`` tokens: its whole
prompt at first (minus a prefix-cache hit), one token per step when decoding.
When the KV pool runs dry the lowest-priority, newest running request is
preempted: its blocks are freed and it is recomputed later.

Fairness: among waiting requests of the best priority present, admission goes
round-robin across tenants: the tenant admitted least recently goes first (its
oldest request), so one tenant's thousand queued sequences delay another
tenant's request by at most one admission per tenant ahead of it, not by the
whole backlog. Priority still comes first; within a tenant order is FIFO.

Running slots are shared the same way: when every slot is taken and a tenant with waiting work runs
fewer than its share (``max_num_seqs`` / tenants with work) while another runs more, the over-share
tenant's newest running request of no better priority is preempted (recomputed later, its prefix blocks
stay cached), one per step, and the freed slot goes to the tenant admitted least recently. A tenant
holding every slot with streams it never reads thus delays another's request by a step, not by its
streams' lifetime.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.request import QueueFullError, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    # The last num_spec_tokens of num_new_tokens are proposed (speculative) tokens, request.spec_token_ids.
    num_spec_tokens: int = 0

    @property
    def completes_prompt(self) -> bool:
        """True when this step reaches the request's last token, so a new token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot fit the KV pool even alone; the engine finishes them.
    unschedulable: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = config.max_num_seqs
        self.max_batched_tokens = config.max_num_batched_tokens
        self.max_waiting = config.max_waiting_requests
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._waiting_tenants: Counter = Counter()  # tenant -> waiting requests
        self._admissions = 0
        self._last_admitted: dict[str, int] = {}  # tenant -> admission count at its last admission
        # LongRoPE's original length (the model's ``rope_long_from``), else None: a sequence longer than it is
        # computed with the long factors throughout (model/rope.py), so one that grows past it is recomputed.
        self.rope_long_from: Optional[int] = None

    # -- queue management -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.check_room()
        if self.rope_long_from is not None and req.num_tokens > self.rope_long_from:
            _mark_rope_long(req)
        self._insert_waiting(req)

    def _crosses_rope_length(self, req: Request) -> bool:
        """Whether running ``req`` has grown past LongRoPE's original length with its KV computed on the short
        factors: like HF (Phi-3 drops its cache there), its whole sequence is then recomputed on the long ones."""
        limit = self.rope_long_from
        return limit is not None and req.num_tokens > limit and not _rope_long(req)

    def _recompute_rope_long(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.kv_evicted = 0
        req.spec_token_ids.clear()
        req.status = RequestStatus.PREEMPTED
        _mark_rope_long(req)
        out.preempted.append(req)
        self._insert_waiting(req)

    def check_room(self, held_elsewhere: int = 0) -> None:
        """Raises QueueFullError when the waiting queue, plus ``held_elsewhere`` requests waiting outside it
        to enter, holds ``max_waiting`` requests."""
        if len(self.waiting) + held_elsewhere >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")

    def readmit(self, req: Request) -> None:
        """Queue a request admitted earlier and held back outside the scheduler (no queue bound: it
        was counted when it arrived)."""
        self._insert_waiting(req)

    def _insert_waiting(self, req: Request) -> None:
        key = req.sort_key()
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].sort_key() > key:
            i -= 1
        self.waiting.insert(i, req)
        self._waiting_tenants[req.tenant] += 1

    def _take_waiting(self, req: Request) -> None:
        self.waiting.remove(req)
        self._waiting_tenants[req.tenant] -= 1
        if not self._waiting_tenants[req.tenant]:
            del self._waiting_tenants[req.tenant]

    def _next_waiting(self) -> Request:
        """The oldest request of the least recently admitted tenant among the best priority waiting.

        Scans only until every tenant with waiting work has been seen once (a tenant never admitted
        wins at once), so one tenant's long queue costs a single step of the scan."""
        top = self.waiting[0].priority
        if len(self._waiting_tenants) == 1:
            return self.waiting[0]
        best, best_last, seen = None, 0, set()
        for r in self.waiting:
            if r.priority != top or len(seen) == len(self._waiting_tenants):
                break
            if r.tenant in seen:
                continue
            seen.add(r.tenant)
            last = self._last_admitted.get(r.tenant, -1)
            if best is None or last < best_last:
                best, best_last = r, last
                if last < 0:
                    break
        return best

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._take_waiting(req)
        self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.kv_evicted = 0
        victim.beam_row = None  # a beam recomputes the row it waited with
        victim.spec_token_ids.clear()
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(victim)

    def _preempt_with_group(
        self, victim: Request, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> None:
        """Preempt ``victim``; a beam is preempted with every running beam of its group (a group steps only
        when all its beams hold a row, so a beam alone out of memory would hold its siblings' blocks idle).
        Beams of a group share a sort key, so a group at the tail of ``running`` leaves it whole."""
        group = victim.beam_group
        for r in list(group.beams) if group is not None else [victim]:
            if r in self.running:
                scheduled.pop(r.request_id, None)
                self._preempt(r)
                out.preempted.append(r)

    def _allocate_running(
        self, req: Request, n: int, needed: int, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> int:
        """Slots for ``n`` tokens of running ``req`` (``needed`` of them real, the rest proposed). Until they
        fit, the proposal is dropped and then the tail of ``running`` preempted (a victim scheduled earlier
        this step leaves ``scheduled``). Returns the tokens allocated, or 0 when ``req`` itself was preempted;
        it was then the last running request."""
        while not self.kv.allocate_slots(req, n):
            if n > needed:  # drop the proposal before preempting anyone for it
                n = needed
                continue
            self._preempt_with_group(self.running[-1], scheduled, out)
            if req.status == RequestStatus.PREEMPTED:
                return 0
        return n

    def _yield_slot_to_starved_tenant(self, out: SchedulerOutput) -> None:
        """All slots taken, a waiting tenant below its share, another above it: preempt the over-share
        tenant's newest running request (``running`` is sorted, so the last is newest and least urgent)."""
        if not self.waiting or len(self.running) < self.max_num_seqs:
            return
        running = Counter(r.tenant for r in self.running)
        share = max(1, self.max_num_seqs // len(set(running) | set(self._waiting_tenants)))
        best_starved = min((r.priority for r in self.waiting if running[r.tenant] < share), default=None)
        if best_starved is None:
            return
        top, count = running.most_common(1)[0]
        if count <= share:
            return
        victim = next(r for r in reversed(self.running) if r.tenant == top)
        if victim.priority >= best_starved:  # never for a request of lower priority (larger value)
            self._preempt_with_group(victim, {}, out)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        now = time.monotonic()

        # Running requests first, in priority order, so preemption victims come from the tail.
        self.running.sort(key=Request.sort_key)
        self._yield_slot_to_starved_tenant(out)
        num_fair = len(out.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._crosses_rope_length(req):
                self._recompute_rope_long(req, out)
                continue
            needed = req.num_tokens - req.num_computed_tokens
            # Proposed tokens are budgeted like any others; a short budget trims the proposal.
            n = min(needed + (len(req.spec_token_ids) if needed == 1 else 0), budget)
            n = self.kv.chunk_end(req, req.num_computed_tokens, n)  # a state checkpoint's block end
            n = self.kv.evict(req, n)  # under a KV budget: blocks given back, a prompt chunk capped
            if n <= 0:
                i += 1
                continue
            num_preempted = len(out.preempted)
            n = self._allocate_running(req, n, needed, scheduled, out)
            if len(out.preempted) != num_preempted:  # victims scheduled earlier gave their tokens back
                budget = self.max_batched_tokens - sum(s.num_new_tokens for s in scheduled.values())
            if n == 0:
                break  # req itself was preempted: victims come from the tail, so no running request is left
            num_spec = max(0, n - needed)
            del req.spec_token_ids[num_spec:]
            scheduled[req.request_id] = ScheduledRequest(req, n, num_spec)
            budget -= n
            i += 1

        # Then waiting requests, unless this step had to preempt for memory (the pool is under pressure).
        if len(out.preempted) == num_fair:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._next_waiting()
                hits, num_hit = ([], 0)
                if req.num_computed_tokens == 0 and req.prompt_logprobs is None:  # those need every row
                    hits, num_hit = self.kv.get_computed_blocks(req)
                policy = req.kv_policy
                if policy is not None and policy.bounded and len(hits) >= policy.budget_blocks:
                    hits = hits[: policy.budget_blocks - 1]  # a budget holds the hit and one block more
                    num_hit = len(hits) * self.kv.block_size
                n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
                n = self.kv.chunk_end(req, req.num_computed_tokens + num_hit, n)
                n = self.kv.evict(req, n + num_hit) - num_hit
                if not self.kv.allocate_slots(req, n, hits):
                    if not self.running and not scheduled:
                        # Nothing else holds blocks, so waiting cannot help: give it up.
                        self._take_waiting(req)
                        out.unschedulable.append(req)
                        continue
                    break
                self._take_waiting(req)
                self._admissions += 1
                self._last_admitted[req.tenant] = self._admissions
                req.num_computed_tokens += num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled[req.request_id] = ScheduledRequest(req, n)
                budget -= n

        if (
            not scheduled
            and self.waiting
            and self.running
            and all(r.beam_row is not None for r in self.running)
        ):
            # Only beams waiting for siblings that cannot get in: the newest group steps back for them.
            self._preempt_with_group(self.running[-1], scheduled, out)
        out.scheduled = list(scheduled.values())
        out.num_batched_tokens = self.max_batched_tokens - budget
        return out

    def expired(self, now: float) -> list[Request]:
        """Requests whose deadline has passed (waiting or running)."""
        return [r for r in self.waiting + self.running if r.deadline is not None and r.deadline <= now]

    def find(self, request_id: str) -> Optional[Request]:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None


_ROPE_LONG_SALT = "\x1frope:long"


def _rope_long(req: Request) -> bool:
    return _ROPE_LONG_SALT in (req.cache_salt or "")


def _mark_rope_long(req: Request) -> None:
    """Salt ``req``'s prefix-cache keys apart from the same tokens computed on LongRoPE's short factors."""
    req.cache_salt = (req.cache_salt or "") + _ROPE_LONG_SALT
    req.block_hashes.clear()
