"""A stream nobody reads stays bounded: engine outputs merge while unread, the HTTP runner applies backpressure."""

from __future__ import annotations

import asyncio
import threading

from sidecar.engine.async_engine import _Stream
from sidecar.engine.request import RequestOutput
from sidecar.server.openai.runner import EVENTS_PER_CHOICE, ChoiceRunner


def output(i: int, finished: bool = False) -> RequestOutput:
    ids = list(range(i + 1))
    return RequestOutput("r", None, [0], ids, "x" * (i + 1), [i], "x", finished, "stop" if finished else None)


def test_unread_outputs_merge_into_one():
    async def main():
        s = _Stream(asyncio.get_running_loop())
        t = threading.Thread(
            target=lambda: [s.put(output(i)) for i in range(500)] + [s.put(output(500, True))]
        )
        t.start()
        t.join()
        await asyncio.sleep(0)  # let the loop run the deliveries
        assert len(s.items) == 1  # 501 unread outputs became one
        merged = await s.get()
        assert merged.new_token_ids == list(range(501)) and merged.delta_text == "x" * 501
        assert merged.token_ids == list(range(501)) and merged.finished  # cumulative fields: the newest
        s.put(RuntimeError("after"))
        await asyncio.sleep(0)
        assert isinstance(await s.get(), RuntimeError)  # errors are delivered, never merged

    asyncio.run(main())


class _Endless:
    """A service whose generate yields events as fast as it is pulled, counting them."""

    def __init__(self) -> None:
        self.pulled = 0

    async def generate(self, caller, req):
        while True:
            self.pulled += 1
            yield object()


def test_a_reader_that_stops_reading_stops_the_pumps():
    async def main():
        svc = _Endless()
        runner = ChoiceRunner(svc, None, [None, None]).start()
        events = runner.events()
        await events.__anext__()  # one read, then the reader goes quiet
        for _ in range(50):
            await asyncio.sleep(0)
        assert runner._queue.qsize() == runner._queue.maxsize == 2 * EVENTS_PER_CHOICE
        assert svc.pulled <= 2 * EVENTS_PER_CHOICE + 3  # each pump holds at most the one it cannot put
        runner.cancel()
        await events.aclose()

    asyncio.run(main())
