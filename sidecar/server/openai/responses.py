"""Responses API bodies <-> the service: input items -> chat messages, events -> output items.

A response is one chat request on the service path: ``instructions`` become the system message,
the stored conversation of ``previous_response_id`` comes next, then this call's ``input`` items
(messages, ``function_call`` and ``function_call_output`` items) as chat messages with tool calls
and tool results. Tools, tool choice and ``text.format`` map onto the same tool-call grammar and
output constraints the chat completions use, so forced calls and schemas are grammar-bound.

``ResponseBuilder`` turns the service's events into output items (a ``message`` with one
``output_text`` part, ``function_call`` items) and into the typed stream events, each numbered by
``sequence_number``; the non-streaming path runs the same builder and keeps only the final object.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from sidecar.engine.structured import Constraint
from sidecar.server.openai.responses_models import ResponsesRequest
from sidecar.server.service import Event, GenerationRequest
from sidecar.server.structured_check import check_constraint
from sidecar.server.tools import ToolSpec
from sidecar.server.validation import invalid, sampling_params

FALLBACK_MAX_TOKENS = 64
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_ROLES = ("user", "assistant", "system", "developer")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _only(item: dict, allowed: set, where: str) -> None:
    extra = sorted(k for k in item if k not in allowed)
    if extra:
        raise invalid(f"{where}.{extra[0]}", "unknown field")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(where, "must be a string")
    return value


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(where, "must be a string or a non-empty list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise invalid(at, "must be an object")
        kind = part.get("type")
        if kind not in ("input_text", "output_text"):
            raise invalid(f"{at}.type", f"{kind!r} is not supported by this server; send input_text")
        _only(part, _PART_KEYS, at)
        texts.append(_text(part.get("text"), f"{at}.text"))
    return "\n".join(texts)


def _message(item: dict, where: str) -> dict:
    _only(item, _MESSAGE_KEYS, where)
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    text = _content(item.get("content"), f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _function_call(item: dict, where: str) -> dict:
    _only(item, _CALL_KEYS, where)
    call = {k: _text(item.get(k), f"{where}.{k}") for k in ("call_id", "name", "arguments")}
    return {"id": call["call_id"], "name": call["name"], "arguments": call["arguments"]}


def _call_output(item: dict, where: str, names: dict[str, str]) -> dict:
    _only(item, _OUTPUT_KEYS, where)
    call_id = _text(item.get("call_id"), f"{where}.call_id")
    out = item.get("output")
    text = out if isinstance(out, str) else _content(out, f"{where}.output")
    msg = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in names:
        msg["name"] = names[call_id]
    return msg


def input_messages(inp: Any, history: list[dict]) -> list[dict]:
    """``input`` -> chat messages (after ``history``, whose calls name the tools that results answer)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    names = {c["id"]: c["name"] for m in history for c in m.get("tool_calls") or []}
    out: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["name"]
            if out and out[-1]["role"] == "assistant":  # one assistant turn: its text and its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, where, names))
        elif kind == "reasoning":  # a thinking model's earlier reasoning: not replayed into the prompt
            _only(item, _REASONING_KEYS, where)
        else:
            raise invalid(f"{where}.type", f"{kind!r} items are not supported by this server")
    return out


def tool_fields(body: ResponsesRequest) -> dict[str, Any]:
    """tools / tool_choice / parallel_tool_calls -> GenerationRequest fields (function tools only)."""
    if body.tools is None and body.tool_choice is None:
        return {}
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            raise invalid(f"tools[{i}].type", f"{t.get('type')!r} tools are not supported; only 'function'")
        _only(t, _TOOL_KEYS, f"tools[{i}]")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        description = t.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"tools[{i}].description", "must be a string")
        tools.append(ToolSpec(t.get("name"), description, params, bool(t.get("strict"))))
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise invalid("tool_choice", "must be none, auto, required or {type: function, name}")
        choice = "function:" + str(choice["name"])
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }


def text_constraint(body: ResponsesRequest) -> Optional[Constraint]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return check_constraint(Constraint("json_object"), "text.format")
    return check_constraint(Constraint("json", fmt.schema_, bool(fmt.strict)), "text.format.schema")


def _effort(body: ResponsesRequest) -> Optional[str]:
    """``reasoning.effort`` as chat's ``reasoning_effort``, which drives a thinking model's template ("xhigh",
    a Responses-only level, thinks as "high" does)."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    return "high" if effort == "xhigh" else effort


def generation_request(
    body: ResponsesRequest, rid: str, messages: list[dict], max_model_len: Optional[int]
) -> GenerationRequest:
    """The one engine request of a response; ``messages`` include instructions and history."""
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise invalid("input", "the conversation must end with a user message or a function_call_output")
    kw: dict[str, Any] = {"max_tokens": body.max_output_tokens or max_model_len or FALLBACK_MAX_TOKENS}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            kw[name] = getattr(body, name)
    kw["structured"] = text_constraint(body)
    return GenerationRequest(
        messages=messages,
        params=sampling_params(**kw),
        request_id=rid,
        model=body.model,
        max_tokens_set=body.max_output_tokens is not None,
        reasoning_effort=_effort(body),
        **tool_fields(body),
    )


def request_echo(body: ResponsesRequest, rid: str, model: str, created: int) -> dict:
    """The fields of a response object that repeat the request (everything but output and usage)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    effort = body.reasoning.effort if body.reasoning is not None else None
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": body.store is not False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice,
        "tools": [{"strict": False, **t, "type": "function"} for t in body.tools or []],
        "truncation": "disabled",
        "user": body.user,
        "error": None,
        "incomplete_details": None,
    }


def response_usage(ev: Optional[Event]) -> dict:
    p, c, cached = (ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens) if ev else (0, 0, 0)
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": ev.reasoning_tokens if ev else 0},
        "total_tokens": p + c,
    }


class ResponseBuilder:
    """Events of one engine request -> output items and typed stream events.

    Text opens a ``message`` item once it has more than whitespace (whitespace before a tool call
    is no message); a completed tool call closes the open message and becomes a ``function_call``
    item, its arguments sent as one delta (calls are parsed whole). Every event carries the next
    ``sequence_number``."""

    def __init__(self, echo: dict) -> None:
        self.echo = echo
        self.output: list[dict] = []
        self.seq = 0
        self.msg: Optional[dict] = None  # the open message item
        self.thought: Optional[dict] = None  # the open reasoning item (a thinking model's think block)
        self.pending = ""  # whitespace not yet given to a message
        self.last: Optional[Event] = None
        self.status = "in_progress"

    def _ev(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def snapshot(self) -> dict:
        out = dict(self.echo, status=self.status, output=self.output)
        out["usage"] = response_usage(self.last) if self.status != "in_progress" else None
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def start(self) -> list[dict]:
        return [
            self._ev("response.created", response=self.snapshot()),
            self._ev("response.in_progress", response=self.snapshot()),
        ]

    def _open_message(self) -> list[dict]:
        self.msg = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.output.append(self.msg)
        ids = {"item_id": self.msg["id"], "output_index": len(self.output) - 1, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._ev(
                "response.output_item.added",
                output_index=ids["output_index"],
                item=dict(self.msg, content=[]),
            ),
            self._ev("response.content_part.added", **ids, part=part),
        ]

    def _text(self, delta: str, force: bool = False) -> list[dict]:
        out: list[dict] = []
        if self.msg is None:
            self.pending += delta
            if not self.pending.strip() and not force:
                return out
            delta, self.pending = self.pending, ""
            out += self._open_message()
            self.msg["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        self.msg["content"][0]["text"] += delta
        ids = {"item_id": self.msg["id"], "output_index": len(self.output) - 1, "content_index": 0}
        out.append(self._ev("response.output_text.delta", **ids, delta=delta, logprobs=[]))
        return out

    def _close_message(self) -> list[dict]:
        if self.msg is None:
            return []
        msg, self.msg = self.msg, None
        if not msg["content"]:
            msg["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        part = msg["content"][0]
        ids = {"item_id": msg["id"], "output_index": self.output.index(msg), "content_index": 0}
        msg["status"] = "completed"
        return [
            self._ev("response.output_text.done", **ids, text=part["text"], logprobs=[]),
            self._ev("response.content_part.done", **ids, part=part),
            self._ev("response.output_item.done", output_index=ids["output_index"], item=msg),
        ]

    def _reasoning(self, delta: str) -> list[dict]:
        out: list[dict] = []
        if self.thought is None:
            self.thought = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                            "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            self.output.append(self.thought)
            item = dict(self.thought, content=[])
            out.append(self._ev("response.output_item.added", output_index=len(self.output) - 1, item=item))
        self.thought["content"][0]["text"] += delta
        ids = {
            "item_id": self.thought["id"],
            "output_index": self.output.index(self.thought),
            "content_index": 0,
        }
        out.append(self._ev("response.reasoning_text.delta", **ids, delta=delta))
        return out

    def _close_reasoning(self) -> list[dict]:
        """Ends the reasoning item: the answer (text or a call) follows a think block, never interleaves it."""
        if self.thought is None:
            return []
        item, self.thought = self.thought, None
        item["status"] = "completed"
        ids = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        return [
            self._ev("response.reasoning_text.done", **ids, text=item["content"][0]["text"]),
            self._ev("response.output_item.done", output_index=ids["output_index"], item=item),
        ]

    def _call(self, call: dict) -> list[dict]:
        out = self._close_message()
        self.pending = ""
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": call["name"],
            "arguments": "",
        }
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out.append(self._ev("response.output_item.added", output_index=at["output_index"], item=dict(item)))
        out.append(self._ev("response.function_call_arguments.delta", **at, delta=call["arguments"]))
        item.update(arguments=call["arguments"], status="completed")
        out.append(
            self._ev(
                "response.function_call_arguments.done", **at, name=call["name"], arguments=call["arguments"]
            )
        )
        out.append(self._ev("response.output_item.done", output_index=at["output_index"], item=item))
        return out

    def feed(self, ev: Event) -> list[dict]:
        self.last = ev
        out = self._reasoning(ev.reasoning_delta) if ev.reasoning_delta else []
        if ev.delta_text or ev.tool_calls or ev.finished:
            out += self._close_reasoning()
        out += self._text(ev.delta_text) if ev.delta_text else []
        for call in ev.tool_calls or []:
            out += self._call(call)
        if ev.finished:
            # a reply of only whitespace, or none, is still one message (after any reasoning item)
            if not any(o["type"] != "reasoning" for o in self.output):
                out += self._text("", force=True) if self.pending else self._open_message()
            out += self._close_message()
            self.status = "incomplete" if ev.finish_reason == "length" else "completed"
            kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
            out.append(self._ev(kind, response=self.snapshot()))
        return out

    def failed(self, error: dict) -> list[dict]:
        """The closing event of a stream that broke after it started (``error``: code and message)."""
        self.status = "failed"
        snap = dict(self.snapshot(), error=error)
        return [self._ev("response.failed", response=snap)]

    def messages(self) -> list[dict]:
        """The reply as chat messages, for the stored conversation."""
        text = "".join(p["text"] for o in self.output if o["type"] == "message" for p in o["content"])
        calls = [
            {"id": o["call_id"], "name": o["name"], "arguments": o["arguments"]}
            for o in self.output
            if o["type"] == "function_call"
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]


def sse_event(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'), ensure_ascii=False)}\n\n"
