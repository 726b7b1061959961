"""Request body limits for the HTTP API (the gRPC server enforces the same ``max_message_bytes``).

A plain ASGI middleware: a declared ``content-length`` over the limit is refused
with 413 before any byte of the body is read; a chunked body is counted as it
arrives and reading stops at the limit, so an oversized body never sits whole in
memory, and is answered 413 too. Each chunk of a body must arrive within the
read timeout (408 otherwise), and ``TimedH11Protocol`` bounds the time a client
may take to send its headers, so slow clients cannot hold connections forever.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sidecar.server.openai.errors import error_body


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers (408 and close after it)."""

    header_timeout_s = 30.0
    _header_timer: Optional[asyncio.TimerHandle] = None

    @classmethod
    def with_timeout(cls, seconds: float) -> type:
        return type("TimedH11Protocol", (cls,), {"header_timeout_s": float(seconds)})

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # headers complete: the request is in the app's hands
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers get a fresh deadline

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            body = b"request headers not received in time"
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-type: text/plain\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
        self.transport.close()


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def _refuse(self, send: Any, status: int = 413) -> None:
        if status == 408:
            err = error_body(
                f"body: no data for {self.read_timeout_s:g} s",
                "invalid_request_error",
                None,
                "request_timeout",
            )
        else:
            err = error_body(
                f"body: larger than the limit of {self.max_bytes} bytes",
                "invalid_request_error",
                None,
                "request_too_large",
            )
        body = json.dumps(err).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        body_done = False
        refused: Optional[int] = None  # status we answer with instead of whatever the app says
        started = False

        async def counted_receive() -> Any:
            nonlocal seen, body_done, refused
            if body_done:  # after the body only a disconnect comes: waiting for it has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                refused = 408
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = 413
                    raise BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        async def guarded_send(message: Any) -> None:
            # The app turns the exception into some error of its own (a 400 for an unreadable
            # body); the client gets the status that says what happened instead.
            nonlocal started
            if refused is not None:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await self._refuse(send, refused)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except (BodyTooLarge, BodyTimeout):
            if not started:
                await self._refuse(send, refused or 413)
