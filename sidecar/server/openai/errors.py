"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Bad input is always a 4xx naming the field: FastAPI's 422 for body
validation becomes 400, malformed JSON is 400, unknown routes keep their
404/405 in the same shape. Only a fault of the server itself is a 500.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sidecar.server.validation import ServiceError

log = logging.getLogger("sidecar.openai")

# ServiceError.code -> (HTTP status, OpenAI error type, OpenAI error code)
_STATUS = {
    "invalid_argument": (400, "invalid_request_error", "invalid_value"),
    "unauthenticated": (401, "authentication_error", "invalid_api_key"),
    "permission_denied": (403, "permission_error", "permission_denied"),
    "failed_precondition": (409, "invalid_request_error", "conflict"),
    "not_found": (404, "invalid_request_error", "model_not_found"),
    "cache_miss": (404, "invalid_request_error", "cache_miss"),
    "rate_limited": (429, "rate_limit_error", "rate_limit_exceeded"),
    "queue_full": (429, "rate_limit_error", "queue_full"),
    "unavailable": (503, "service_unavailable_error", "service_unavailable"),
    "deadline_exceeded": (504, "timeout_error", "deadline_exceeded"),
    "internal": (500, "server_error", "internal_error"),
}
# Pydantic's location parts that name a union member rather than a field.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_body(message: str, etype: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


# Routes of the Anthropic Messages API answer errors in Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """``{"type": "error", "error": {"type", "message"}}`` for an HTTP status."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def _reply(request: Request, body: dict, status: int, headers: Optional[dict] = None) -> JSONResponse:
    """The error response in the shape of the API the request was made to."""
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def _public_field(name: Optional[str]) -> Optional[str]:
    """The service names sampling fields ``sampling.x``; over HTTP they are top-level ``x``."""
    if name and name.startswith("sampling."):
        return name[len("sampling.") :]
    return name


def service_error_body(exc: ServiceError) -> tuple[int, dict]:
    status, etype, code = _STATUS.get(exc.code, _STATUS["internal"])
    message = exc.message[len("sampling.") :] if exc.message.startswith("sampling.") else exc.message
    # Only these codes are about a request field; "draining: ..." names a state, not a param.
    param = (
        _public_field(exc.field)
        if exc.code in ("invalid_argument", "not_found", "failed_precondition")
        else None
    )
    return status, error_body(message, etype, param, code)


def _service_headers(exc: ServiceError, status: int) -> dict:
    headers = {}
    if exc.retry_after_s is not None and status == 429:
        # Retry-After takes whole seconds; round up so a client that obeys it is admitted.
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return headers


def _field(loc: tuple) -> Optional[str]:
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or any(c in part for c in "[]-"):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def validation_body(errors: list[dict[str, Any]]) -> dict:
    """One message for one offending field.

    Pydantic reports every member of a union separately; the deepest location
    is the member the client evidently meant (a list of parts rather than a
    string), so that one names the field.
    """
    special = [e for e in errors if e.get("type") in ("json_invalid", "unsupported_field", "invalid_value")]
    first = special[0] if special else max(errors, key=lambda e: len(e.get("loc", ())))
    etype = first.get("type", "")
    ctx = first.get("ctx") or {}
    if etype == "json_invalid":
        return error_body(
            f"body: malformed JSON ({ctx.get('error', 'decode error')})",
            "invalid_request_error",
            None,
            "invalid_json",
        )
    if etype == "unsupported_field":
        return error_body(first["msg"], "invalid_request_error", ctx.get("field"), "unsupported_parameter")
    if etype == "invalid_value":
        msg = first["msg"]
        return error_body(msg, "invalid_request_error", msg.partition(":")[0], "invalid_value")
    field = _field(tuple(first.get("loc", ())))
    if field is None:
        if etype == "missing":
            return error_body(
                "body: a JSON object is required", "invalid_request_error", None, "invalid_value"
            )
        return error_body(
            f"body: must be a JSON object ({first['msg']})", "invalid_request_error", None, "invalid_value"
        )
    if etype == "extra_forbidden":
        # Name every unknown field of the same object, so one round trip shows all typos.
        parent = tuple(first.get("loc", ()))[:-1]
        names = [
            _field(tuple(e["loc"]))
            for e in errors
            if e.get("type") == "extra_forbidden" and tuple(e.get("loc", ()))[:-1] == parent
        ]
        label = "unknown field" if len(names) == 1 else "unknown fields"
        return error_body(f"{', '.join(names)}: {label}", "invalid_request_error", field, "unknown_parameter")
    msgs: list[str] = []
    for e in errors:
        if _field(tuple(e.get("loc", ()))) == field and e["msg"] not in msgs:
            msgs.append(e["msg"])
    if etype == "missing":
        msgs = ["field required"]
    return error_body(f"{field}: {'; or '.join(msgs)}", "invalid_request_error", field, "invalid_value")


def install(app: FastAPI, on_error: Callable[[str], None]) -> None:
    """Exception handlers; ``on_error(code)`` counts each refusal by its ServiceError code."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        log.info("request refused", extra={"code": exc.code, "error": exc.message})
        on_error(exc.code)
        status, body = service_error_body(exc)
        return _reply(request, body, status, _service_headers(exc, status))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error("invalid_argument")
        return _reply(request, validation_body(list(exc.errors())), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        etype = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _reply(
            request,
            error_body(str(exc.detail), etype, None, None),
            exc.status_code,
            getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _reply(
            request, error_body("internal server error", "server_error", None, "internal_error"), 500
        )


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_DOCUMENTED = {
    "400": "Invalid request (the message names the field)",
    "401": "Missing or invalid API key",
    "404": "Unknown model",
    "429": "Rate limited or queue full (see Retry-After)",
    "503": "Loading or draining",
}


def document_errors(app: FastAPI) -> None:
    """Publish the real error statuses in /openapi.json instead of FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path, ops in schema.get("paths", {}).items():
            if not path.startswith("/v1/"):
                continue
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status, text in _DOCUMENTED.items():
                    responses.setdefault(
                        status,
                        {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
                    )
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
