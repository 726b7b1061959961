"""Runs the engine requests behind one HTTP call (n choices x prompts) concurrently.

Each choice is one ``InferenceService.generate`` iterator drained by its own
task into a shared queue, so choices progress together and the HTTP layer reads
one merged stream of ``(choice index, event)``.

Invariant: every iterator is closed when the runner is closed, whatever way
the call ends (finished, error, client gone, handler cancelled); closing a
service iterator aborts its engine request and frees its KV blocks.
``cancel()`` is synchronous on purpose: it is called from ``finally`` blocks
that may run inside an already-cancelled anyio scope, where any ``await``
would be interrupted again.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request

_END = object()
# Events buffered per choice between the engine side and the HTTP writer. Full, the choices' pumps wait
# (backpressure): a client that does not read leaves its engine outputs merged into one pending output
# per request (AsyncEngine's stream), never a growing list of cumulative copies.
EVENTS_PER_CHOICE = 8
# Tasks still unwinding after cancel(); held here so they are not garbage-collected mid-cleanup.
_closing: set[asyncio.Task] = set()


class ChoiceRunner:
    def __init__(self, service: Any, caller: Any, requests: list[Any]) -> None:
        self._service = service
        self._caller = caller
        self._requests = requests
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=EVENTS_PER_CHOICE * max(1, len(requests)))
        self._tasks: list[asyncio.Task] = []
        self._open = 0

    def start(self) -> "ChoiceRunner":
        for i, req in enumerate(self._requests):
            self._tasks.append(asyncio.create_task(self._pump(i, req)))
        self._open = len(self._tasks)
        return self

    async def _pump(self, index: int, req: Any) -> None:
        it = None
        try:
            it = self._service.generate(self._caller, req)
            if inspect.isawaitable(it):  # `async def` returning an iterator, or an async generator
                it = await it
            async for event in it:
                await self._queue.put((index, event))
            await self._queue.put((index, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the reader, which maps it to an HTTP error
            await self._queue.put((index, exc))
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """Merged events until every choice has ended; re-raises the first failure."""
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.cancel()
                raise item
            yield index, item

    def cancel(self) -> None:
        for t in self._tasks:
            if not t.done():
                t.cancel()
                _closing.add(t)
                t.add_done_callback(_closing.discard)
        self._open = 0


async def first_events(
    runner: ChoiceRunner, n: int, events: AsyncIterator[tuple[int, Any]]
) -> list[tuple[int, Any]]:
    """Read until each of the ``n`` choices has produced one event (or all ended).

    Used before an HTTP response starts, so errors raised before the first event
    (validation, auth, rate limit, ...) still become a proper status code and the
    cache outcome is known for the response header.
    """
    buffered: list[tuple[int, Any]] = []
    seen: set[int] = set()
    async for index, event in events:
        buffered.append((index, event))
        seen.add(index)
        if len(seen) == n:
            break
    return buffered


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away. Only call once the body has been read."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def guard_disconnect(request: Request, runner: ChoiceRunner, work: Any) -> Optional[Any]:
    """Await ``work`` but cancel the runner if the client disconnects first (returns None then).

    Non-streaming calls and the start of streaming calls go through here: no
    bytes are being sent yet, so nothing else would notice a client that left.
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        runner.cancel()
        work_task.cancel()
        return None
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
