"""Overlapped decode steps: the host finishes step N-1 while the device runs step N.

A pipeline starts from a scheduled step in which every request decodes one token and samples (no prompt
chunk, no proposed tokens, no grammar, speculative decoding off): it is launched -- forward, sampling,
and the start of the ids' copy to the host -- without waiting, and stays in flight. The next
``LLMEngine.step`` then, when the batch can go on as it is (no request waiting to be admitted, every
running request in the in-flight step, a KV slot for each), launches step N from the in-flight step's
ids ON THE DEVICE (each row's input id is gathered from the previous step's sampled ids into the
persistent input buffer) before it reads those ids back, appends them, checks stops, detokenizes and
emits. Anything else drains the pipeline: the in-flight step is read back and the plain synchronous step
runs in the same call.

Invariants:
- A request in flight has ``num_computed_tokens`` one past its known tokens while the step runs (its
  sampled token is computed by the next step before the host knows it); ``Sampler.sample_async(ahead=1)``
  keys its draw and penalty counts as if that token were appended, so overlapped outputs equal
  synchronous ones token for token (greedy, and seeded through the keyed draws).
- A request that finishes when step N-1 is read back (stop token or string, length) while it has a row
  in step N gets that row discarded: ``num_computed_tokens`` is wound back over it and the slot it took is
  freed with the request's blocks; its token from step N is never read. Rows of requests that were
  aborted, expired or preempted after their launch are dropped at readback.
- Requests that step N-1's token certainly finishes by length take no row in step N.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from sidecar.engine.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from sidecar.engine.sampler import PendingSample

log = logging.getLogger("sidecar.engine")


def append_sampled(
    engine,
    req: Request,
    token_ids: list[int],
    logprobs: list[Optional[TokenLogprob]],
    now: float,
    outputs: list[RequestOutput],
    in_flight: int = 0,
) -> None:
    """Append a request's newly sampled tokens (those after a stop are dropped), finish it on a stop, and
    emit its output. ``in_flight``: rows of it launched since these tokens were sampled; they are discarded
    when it finishes here."""
    if req.first_token_time is None:
        req.first_token_time = now
    reason = None
    for tok, lp in zip(token_ids, logprobs):
        req.append_token(tok)
        if lp is not None:
            req.logprobs.append(lp)
        engine.counters["generation_tokens"] += 1
        reason = engine._check_stop(req, tok)
        if reason is not None:
            break
    broken = engine.structured.failed.pop(req.request_id, None)  # its grammar cannot go on
    if reason is None and req.request_id in engine.structured.ended:  # its grammar's end rule ends it here
        reason = FinishReason.STOP
    if broken is not None:
        engine._finish(req, FinishReason.ABORT, f"error: structured: cannot be enforced: {broken}")
    elif reason is not None:
        req.num_computed_tokens -= in_flight  # the discarded rows' slots go back with the request's blocks
        engine._finish(req, reason)
    else:
        if len(token_ids) > 1:
            engine.kv.cache_computed_blocks(req)
        req.text = req.detok.visible_text(False)
    outputs.append(req.make_output())


@dataclass
class InFlight:
    reqs: list[Request]  # row i sampled pending.token_ids[i]
    pending: PendingSample
    number: int  # launches so far, this one included (for traces)


class OverlapPipeline:
    """Owned by LLMEngine; ``enabled`` is fixed at construction. ``trace``, when a list, records
    ("launch", number, request ids) and ("readback", number) in the order they happen."""

    def __init__(self, engine, enabled: bool) -> None:
        self.engine = engine
        self.enabled = enabled
        self.inflight: Optional[InFlight] = None
        self.trace: Optional[list] = None
        self._launches = 0

    def _eligible(self, reqs: list[Request]) -> bool:
        # Grammar rows need the previous token on the host first; adapter rows run eagerly with their
        # low-rank updates (the launched step is the base model's).
        return (
            self.enabled
            and not self.engine.spec.enabled
            and all(r.params.structured is None and r.lora is None and r.beam_group is None for r in reqs)
            # a launched step allocates no eviction: a budgeted sequence steps through the scheduler
            and not any(r.kv_policy is not None and r.kv_policy.bounded for r in reqs)
        )

    def launch_scheduled(self, sched) -> bool:
        """Start a pipeline with the scheduler's step when it is a plain decode of every row; False (nothing
        run) otherwise."""
        ss = sched.scheduled
        if self.inflight is not None or not all(
            s.num_new_tokens == 1 and not s.num_spec_tokens and s.completes_prompt for s in ss
        ):
            return False
        e, reqs = self.engine, [s.request for s in ss]
        if not self._eligible(reqs):
            return False
        logits = e.runner.launch_decode(reqs, e.kv)
        if logits is None:
            return False
        self._computed(reqs)
        self._start(reqs, logits, 0)
        return True

    def advance(self, outputs: list[RequestOutput]) -> bool:
        """With a step in flight: launch the next one from its device ids when the batch can go on, then read
        the in-flight step back. True when this was the engine's step; False when the pipeline drained (the
        in-flight step was read back) or was empty, and the plain step should run."""
        p = self.inflight
        if p is None:
            return False
        self.inflight = None
        nxt: Optional[list[Request]] = None
        try:
            nxt = self._launch_next(p)
            self._readback(p, outputs, {id(r) for r in nxt or ()})
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("overlapped engine step failed")
            self.inflight = None
            self._fail(p.reqs + list(nxt or ()), exc, outputs)
            return True
        return nxt is not None

    def _launch_next(self, p: InFlight) -> Optional[list[Request]]:
        e = self.engine
        alive = [r for r in p.reqs if r.status == RequestStatus.RUNNING]
        # A waiting request drains the pipeline only when the synchronous step could admit it.
        admits = e.scheduler.waiting and len(e.scheduler.running) < e.config.max_num_seqs
        if (
            not alive
            or admits
            or len(alive) > e.config.max_num_batched_tokens
            or {id(r) for r in e.scheduler.running} != {id(r) for r in alive}
            or not self._eligible(alive)
        ):
            return None
        nxt = [
            r
            for r in alive
            if len(r.output_token_ids) + 1 < r.params.max_tokens and r.num_tokens + 1 < e.max_model_len
        ]
        if not nxt or not all(e.kv.allocate_slots(r, 1) for r in nxt):
            return None  # a slot already given stays the request's: the synchronous step needs it too
        row_of = {id(r): i for i, r in enumerate(p.reqs)}
        prev = p.pending.token_ids.to(e.runner.device)
        logits = e.runner.launch_decode(nxt, e.kv, prev, [row_of[id(r)] for r in nxt])
        if logits is None:
            return None
        e.counters["num_steps"] += 1
        self._computed(nxt)
        self._start(nxt, logits, 1)
        return nxt

    def _computed(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.num_computed_tokens += 1
            self.engine.kv.cache_computed_blocks(r)  # registers only blocks whose tokens are all known

    def _start(self, reqs: list[Request], logits, ahead: int) -> None:
        e = self.engine
        pending = e.sampler.sample_async(e.sampling_logits(logits), reqs, ahead=ahead)
        self._launches += 1
        self.inflight = InFlight(reqs, pending, self._launches)
        if self.trace is not None:
            self.trace.append(("launch", self._launches, [r.request_id for r in reqs]))

    def _readback(self, p: InFlight, outputs: list[RequestOutput], in_next: set) -> None:
        if self.trace is not None:
            self.trace.append(("readback", p.number))
        out = p.pending.result()
        now = time.monotonic()
        for req, tok, lp in zip(p.reqs, out.ids, out.logprobs):
            if req.status != RequestStatus.RUNNING:
                continue  # finished (abort, deadline) or preempted since its launch: the row is dropped
            append_sampled(self.engine, req, [tok], [lp], now, outputs, 1 if id(req) in in_next else 0)

    def drain(self, outputs: list[RequestOutput]) -> None:
        """Read back the step in flight, if any (nothing is launched)."""
        p, self.inflight = self.inflight, None
        if p is not None:
            self._readback(p, outputs, set())

    def _fail(self, reqs: list[Request], exc: Exception, outputs: list[RequestOutput]) -> None:
        seen = set()
        for r in reqs:
            if id(r) not in seen and not r.is_finished:
                self.engine._finish(r, FinishReason.ABORT, f"error: {type(exc).__name__}: {exc}")
                outputs.append(r.make_output())
            seen.add(id(r))
