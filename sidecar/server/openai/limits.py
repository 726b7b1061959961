"""Request body size limit for the HTTP API (the gRPC server enforces the same ``max_message_bytes``).

A plain ASGI middleware: a declared ``content-length`` over the limit is refused
with 413 before any byte of the body is read; a chunked body is counted as it
arrives and reading stops at the limit, so an oversized body never sits whole in
memory.
"""
from __future__ import annotations

import json
from typing import Any

from sidecar.server.openai.errors import error_body


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(error_body(f"body: larger than the limit of {self.max_bytes} bytes",
                                     "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
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

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, counted_receive, send)
