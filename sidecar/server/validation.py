"""Request validation shared by every API. Errors name the wire field."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from sidecar.cache.policy import CACHE_CONTROLS
from sidecar.engine.request import SamplingParams

CODES = (
    "invalid_argument",
    "unauthenticated",
    "permission_denied",
    "failed_precondition",
    "rate_limited",
    "queue_full",
    "unavailable",
    "not_found",
    "deadline_exceeded",
    "cache_miss",
    "internal",
)
ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class ServiceError(Exception):
    """A refusal with a protocol-neutral code; adapters map it to a status."""

    def __init__(
        self, code: str, message: str, field: Optional[str] = None, retry_after_s: Optional[float] = None
    ) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field if field is not None else _field_of(message)
        self.retry_after_s = retry_after_s


def _field_of(message: str) -> Optional[str]:
    head, sep, _ = message.partition(":")
    return head if sep and " " not in head else None


def invalid(field: str, problem: str) -> ServiceError:
    return ServiceError("invalid_argument", f"{field}: {problem}", field=field)


def sampling_params(**kwargs: Any) -> SamplingParams:
    """Build SamplingParams from wire values; errors are named ``sampling.<field>``."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ServiceError("invalid_argument", f"sampling.{exc}") from None
    except TypeError as exc:
        raise ServiceError("invalid_argument", f"sampling: {exc}", field="sampling") from None


def check_request_id(rid: Any) -> None:
    """Request ids are echoed and logged: visible ASCII only (no spaces, no line breaks), bounded."""
    if not rid:
        return
    if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID} characters")
    if not _REQUEST_ID.fullmatch(rid):
        raise invalid(
            "request_id", "only visible ASCII characters (no spaces or control characters) are allowed"
        )


def check_text(field: str, value: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (JSON "\\ud800") names its field."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            field,
            f"contains an unpaired surrogate (U+{ord(value[exc.start]):04X}) at index "
            f"{exc.start}; text must be valid Unicode",
        ) from None


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(m.get("content"), str):
            raise invalid(f"messages[{i}].content", "must be a string")
        check_text(f"messages[{i}].content", m["content"])
        if role == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise invalid(f"messages[{i}].tool_call_id", "required for a tool message")
        for j, c in enumerate(m.get("tool_calls") or []):
            if role != "assistant":
                raise invalid(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
                raise invalid(f"messages[{i}].tool_calls[{j}].name", "must be a non-empty string")
            if not isinstance(c.get("arguments"), str):
                raise invalid(f"messages[{i}].tool_calls[{j}].arguments", "must be a JSON string")
            check_text(f"messages[{i}].tool_calls[{j}].arguments", c["arguments"])
    if messages[-1]["role"] not in ("user", "tool"):
        raise invalid(
            "messages", f"the last message must be from the user or a tool, got {messages[-1]['role']!r}"
        )


def check_request(req: Any, model_name: str, vocab_size: Optional[int], max_prompt_chars: int) -> None:
    """Validate a GenerationRequest in wire order; raises ServiceError on the first problem."""
    if req.model and req.model != model_name:
        raise ServiceError(
            "not_found",
            f"model: unknown model {req.model!r}; this sidecar serves {model_name!r}",
            field="model",
        )
    given = [
        n
        for n, v in (
            ("prompt", req.prompt),
            ("prompt_token_ids", req.prompt_token_ids),
            ("messages", req.messages),
        )
        if v
    ]
    if req.messages is not None and not req.messages:
        raise invalid("messages", "at least one message is required")
    if len(given) != 1:
        if req.messages is None:
            raise invalid(
                "prompt",
                "exactly one of prompt and prompt_token_ids must be set"
                + (", got both" if len(given) > 1 else ""),
            )
        raise invalid("messages", "set messages only, not a prompt as well")
    if req.messages is not None:
        check_messages(req.messages)
        chars = sum(len(m["content"]) for m in req.messages)
        if chars > max_prompt_chars:
            raise invalid("messages", f"total content is {chars} characters, more than {max_prompt_chars}")
    elif req.prompt is not None and req.prompt != "":
        if not isinstance(req.prompt, str):
            raise invalid("prompt", "must be a string")
        if len(req.prompt) > max_prompt_chars:
            raise invalid("prompt", f"{len(req.prompt)} characters, more than {max_prompt_chars}")
        check_text("prompt", req.prompt)
    else:
        for i, t in enumerate(req.prompt_token_ids):
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise invalid("prompt_token_ids", f"token id {t!r} at index {i} is outside [0, {vocab_size})")
    check_request_id(req.request_id)
    if not isinstance(req.priority, int) or not (-(2**31) <= req.priority < 2**31):
        raise invalid("priority", f"must be a 32-bit integer, got {req.priority!r}")
    if req.cache_control not in CACHE_CONTROLS:
        raise invalid(
            "cache_control", f"must be one of {', '.join(CACHE_CONTROLS)}, got {req.cache_control!r}"
        )
    if not isinstance(req.cache_salt, str) or len(req.cache_salt) > 256:
        raise invalid("cache_salt", "must be a string of at most 256 characters")
    if req.timeout_s is not None and req.timeout_s <= 0:
        raise ServiceError("deadline_exceeded", "deadline exceeded before the request started")
    for i, stop in enumerate(req.params.stop):
        if isinstance(stop, str):
            check_text(f"sampling.stop[{i}]", stop)
    check_text("cache_salt", req.cache_salt)
    if req.params.beam_width is not None and getattr(req, "tools", None):
        raise invalid("tools", "cannot be used with beam search (beam_width)")
    try:
        req.params.validate(vocab_size)
    except ValueError as exc:
        raise ServiceError("invalid_argument", f"sampling.{exc}") from None
