"""In-flight coalescing: identical cacheable requests share one engine generation.

A request that is cacheable under the cache policy (it would be looked up and stored) and is identical
to one still generating (same cache scope: tenant, model, answer-changing settings, conversation; same
prompt token ids; same adapter) does not start a generation of its own. It follows the running one
(the *flight*): it receives the output so far and then every later output, as if it were its own.

Hand-over: the flight is driven by one participant, its leader. When the leader goes (its caller
cancels or disconnects, its deadline passes, the engine aborts it), the first follower to notice
takes over and starts its own engine request. Every participant tracks how much text and how many
tokens it has already delivered, so after a take-over it only delivers what lies beyond that; greedy
decoding reproduces the same prefix. No participant ever fails because another one left.

Everything here runs on the event loop; no locks are needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from typing import Any, AsyncIterator, Callable, Optional

StreamFactory = Callable[[], AsyncIterator[Any]]


class Flight:
    """One generation shared by identical requests; ``latest`` is the newest cumulative output."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.latest: Any = None
        self.leader: Optional["Participant"] = None
        self.done = False  # the leader's stream finished with stop/length: ``latest`` is final
        self.members = 0
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, timeout: Optional[float]) -> None:
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class Participant:
    """The stream one caller consumes: an engine stream while it leads, the flight's outputs otherwise.

    Contract: behaves like ``AsyncEngine.generate``'s stream (``__anext__`` / ``aclose``); errors from
    its own engine request (after a take-over) propagate unchanged; a follower whose ``deadline``
    passes gets an ``abort`` output with ``abort_reason="deadline"``.
    """

    def __init__(
        self,
        coalescer: "Coalescer",
        flight: Flight,
        factory: StreamFactory,
        deadline: Optional[float],
        on_follow: Callable[[], None],
    ) -> None:
        self._co = coalescer
        self.flight = flight
        self._factory = factory
        self._deadline = deadline
        self._on_follow = on_follow
        self._stream: Optional[AsyncIterator[Any]] = None
        self._took_over = False
        self._chars = 0
        self._tokens = 0
        self._yielded = False
        self._closed = False
        flight.members += 1
        if flight.leader is None and not flight.done and flight.latest is None:
            self._lead()
        else:
            on_follow()

    @property
    def leading(self) -> bool:
        return self.flight.leader is self

    def _lead(self) -> None:
        self.flight.leader = self
        self._stream = self._factory()

    def __aiter__(self) -> "Participant":
        return self

    async def __anext__(self) -> Any:
        while True:
            if self.leading:
                return await self._next_as_leader()
            f = self.flight
            out = f.latest
            if out is not None and (
                not self._yielded
                or f.done
                or len(out.text) > self._chars
                or len(out.token_ids) > self._tokens
            ):
                return self._view(out)
            if f.leader is None and not f.done:  # the leader left: this follower generates from here on
                self._took_over = True
                self._lead()
                continue
            timeout = None if self._deadline is None else self._deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return self._deadline_output()
            await f.wait(timeout)

    async def _next_as_leader(self) -> Any:
        f = self.flight
        try:
            out = await self._stream.__anext__()
        except BaseException:
            self._leave_lead()
            raise
        if out.finished and out.finish_reason == "abort":
            self._leave_lead()  # followers take over; the abort is this caller's alone
            return out
        f.latest = out
        if out.finished:
            f.done = True
        f.notify()
        if not self._took_over:
            self._chars, self._tokens, self._yielded = len(out.text), len(out.token_ids), True
            return out
        return self._view(out)

    def _leave_lead(self) -> None:
        if self.flight.leader is self:
            self.flight.leader = None
            self.flight.notify()

    def _view(self, out: Any) -> Any:
        """``out`` as this participant sees it: deltas relative to what it has delivered already."""
        delta = out.text[self._chars :] if len(out.text) > self._chars else ""
        new_ids = list(out.token_ids[self._tokens :]) if len(out.token_ids) > self._tokens else []
        self._chars, self._tokens = max(self._chars, len(out.text)), max(self._tokens, len(out.token_ids))
        self._yielded = True
        if out.finished and out.finish_reason != "abort":
            # A finished view carries the whole answer even if this participant saw only a prefix.
            return dataclasses.replace(out, delta_text=delta, new_token_ids=new_ids, new_logprobs=None)
        return dataclasses.replace(out, delta_text=delta, new_token_ids=new_ids, new_logprobs=None)

    def _deadline_output(self) -> Any:
        out = self.flight.latest
        if out is None:  # nothing generated yet: an empty output in the engine's own shape
            from sidecar.engine.request import RequestOutput

            out = RequestOutput(
                request_id="",
                prompt=None,
                prompt_token_ids=[],
                token_ids=[],
                text="",
                new_token_ids=[],
                delta_text="",
                finished=False,
            )
        return dataclasses.replace(
            out,
            finished=True,
            finish_reason="abort",
            abort_reason="deadline",
            delta_text="",
            new_token_ids=[],
            new_logprobs=None,
        )

    async def aclose(self) -> None:
        """Leave the flight; a leader's engine request is aborted and a follower takes over."""
        if self._closed:
            return
        self._closed = True
        f = self.flight
        f.members -= 1
        try:
            if self._stream is not None:
                await self._stream.aclose()
        finally:
            self._leave_lead()
            if f.members == 0 or f.done:
                # Removed only now (after the caller stored the answer): a request arriving between
                # the final output and the store still finds the flight instead of a cache miss.
                self._co.forget(f)


class Coalescer:
    """Registry of running flights by request identity; ``coalesced`` counts followers."""

    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._flights)

    def stream(
        self,
        key: str,
        factory: StreamFactory,
        deadline: Optional[float] = None,
        on_follow: Callable[[], None] = lambda: None,
    ) -> Participant:
        """Join (or open) the flight for ``key``. ``factory`` starts this caller's own engine stream and is
        called only if this caller leads; ``on_follow`` runs when it joins as a follower."""
        f = self._flights.get(key)
        if f is None:
            f = self._flights[key] = Flight(key)

        def followed() -> None:
            self.coalesced += 1
            on_follow()

        return Participant(self, f, factory, deadline, followed)

    def forget(self, f: Flight) -> None:
        if self._flights.get(f.key) is f:
            del self._flights[f.key]


def flight_key(scope_key: str, prompt: list[int], model: Optional[str]) -> str:
    """Identity of a generation: the cache scope (tenant, settings, conversation), the exact prompt and
    the adapter. Two requests with this key produce the same greedy answer."""
    raw = json.dumps([scope_key, model or "", prompt], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()
