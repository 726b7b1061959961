"""Anthropic Messages bodies <-> the service: content blocks -> chat messages, events -> blocks.

``POST /v1/messages`` is one chat request on the service path: ``system`` becomes the system
message, ``text`` blocks the content, an assistant's ``tool_use`` blocks its tool calls and a
user's ``tool_result`` blocks tool messages; ``tools``/``tool_choice`` map onto the same tool-call
grammar as the OpenAI routes (``any`` is ``required``, ``tool`` a named function).

``MessageBuilder`` turns the service's events into content blocks (one ``text`` block, then
``tool_use`` blocks) and into the Messages stream events (``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Callable, Optional, Union

from pydantic import Field

from sidecar.engine.request import MAX_STOP_STRINGS
from sidecar.server.openai.models import _Strict
from sidecar.server.service import Event, GenerationRequest
from sidecar.server.tools import ToolSpec
from sidecar.server.validation import invalid, sampling_params

_TEXT_KEYS = {"type", "text", "cache_control", "citations"}
_TOOL_USE_KEYS = {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}
_TOOL_RESULT_KEYS = {"type", "tool_use_id", "content", "is_error", "cache_control"}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
# finish_reason -> stop_reason
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
# How many final tokens to look through for the stop sequence that ended a reply.
_STOP_TAIL_TOKENS = 16


class AnthropicMetadata(_Strict):
    user_id: Optional[str] = Field(None, max_length=256)


class MessagesRequest(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=4096)]
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: Optional[
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)]
    ] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: Optional[bool] = None
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=128)]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[AnthropicMetadata] = None
    # Prompt caching is automatic here (the prefix cache): a cache breakpoint is accepted as a no-op.
    cache_control: Optional[dict[str, Any]] = None


def _only(item: dict, allowed: set, where: str) -> None:
    extra = sorted(k for k in item if k not in allowed)
    if extra:
        raise invalid(f"{where}.{extra[0]}", "unknown field")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(where, "must be a string")
    return value


def _text_blocks(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(where, "must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else None
            raise invalid(f"{where}[{j}].type", f"{kind!r} blocks are not supported here; send text")
        _only(b, _TEXT_KEYS, f"{where}[{j}]")
        out.append(_str(b.get("text"), f"{where}[{j}].text"))
    return "\n".join(out)


def _blocks(m: dict, where: str, names: dict[str, str]) -> list[dict]:
    """One Anthropic message -> chat messages (tool results come before the user's text)."""
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", f"must be user or assistant, got {role!r}")
    _only(m, {"role", "content"}, where)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            _only(b, _TEXT_KEYS, at)
            texts.append(_str(b.get("text"), f"{at}.text"))
        elif kind == "tool_use" and role == "assistant":
            _only(b, _TOOL_USE_KEYS, at)
            call = {"id": _str(b.get("id"), f"{at}.id"), "name": _str(b.get("name"), f"{at}.name")}
            if not isinstance(b.get("input"), dict):
                raise invalid(f"{at}.input", "must be an object")
            calls.append(dict(call, arguments=json.dumps(b["input"], ensure_ascii=False)))
            names[call["id"]] = call["name"]
        elif kind == "tool_result" and role == "user":
            _only(b, _TOOL_RESULT_KEYS, at)
            tid = _str(b.get("tool_use_id"), f"{at}.tool_use_id")
            text = _text_blocks(b.get("content", ""), f"{at}.content")
            msg = {"role": "tool", "tool_call_id": tid, "content": text}
            results.append(dict(msg, name=names[tid]) if tid in names else msg)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not replayed into the prompt
        else:
            raise invalid(f"{at}.type", f"{kind!r} blocks are not supported in {role} messages")
    out = results
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        out = out + [dict(msg, tool_calls=calls) if calls else msg]
    return out


def chat_messages(body: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text_blocks(body.system, "system")})
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        out += _blocks(m, f"messages[{i}]", names)
    if out[-1]["role"] not in ("user", "tool"):
        raise invalid("messages", "the last message must be the user's (assistant prefill is not supported)")
    return out


def tool_fields(body: MessagesRequest) -> dict[str, Any]:
    if body.tools is None and body.tool_choice is None:
        return {}
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.get("type", "custom") != "custom":
            raise invalid(f"tools[{i}].type", f"{t.get('type')!r} tools are not supported; only custom tools")
        _only(t, _TOOL_KEYS, f"tools[{i}]")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"tools[{i}].input_schema", "must be a JSON schema object")
        tools.append(
            ToolSpec(t.get("name"), _str(t.get("description", ""), f"tools[{i}].description"), schema)
        )
    tc = body.tool_choice or {"type": "auto"}
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if tc.get("type") == "tool":
        choice = "function:" + _str(tc.get("name"), "tool_choice.name")
    elif tc.get("type") in kinds:
        choice = kinds[tc["type"]]
    else:
        raise invalid("tool_choice.type", "must be auto, any, tool or none")
    _only(tc, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    parallel = not tc.get("disable_parallel_tool_use", False)
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def generation_request(body: MessagesRequest, rid: str) -> GenerationRequest:
    kw: dict[str, Any] = {"max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            kw[name] = getattr(body, name)
    if body.stop_sequences:
        kw["stop"] = list(body.stop_sequences)
    return GenerationRequest(
        messages=chat_messages(body),
        params=sampling_params(**kw),
        request_id=rid,
        model=body.model,
        **tool_fields(body),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class MessageBuilder:
    """Events of one engine request -> content blocks and Messages stream events.

    Text opens a ``text`` block once it has more than whitespace; a completed tool call closes it
    and becomes a ``tool_use`` block whose input is sent as one ``input_json_delta``."""

    def __init__(self, rid: str, model: str, stop_sequences: list[str], token_text: Callable) -> None:
        self.rid, self.model, self.stops, self.token_text = rid, model, stop_sequences, token_text
        self.content: list[dict] = []
        self.open: Optional[dict] = None  # the open text block
        self.pending = ""
        self.last: Optional[Event] = None
        self.stop_reason: Optional[str] = None
        self.stop_sequence: Optional[str] = None

    def usage(self) -> dict:
        ev = self.last
        prompt, cached, out = (ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens) if ev else (0, 0, 0)
        return {
            "input_tokens": prompt - cached,
            "output_tokens": out,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def message(self) -> dict:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    def start(self, first: Event) -> list[dict]:
        self.last = first
        msg = dict(self.message(), content=[], usage=dict(self.usage(), output_tokens=0))
        return [{"type": "message_start", "message": msg}]

    def _text(self, delta: str, force: bool = False) -> list[dict]:
        out: list[dict] = []
        if self.open is None:
            self.pending += delta
            if not self.pending.strip() and not force:
                return out
            delta, self.pending = self.pending, ""
            self.open = {"type": "text", "text": ""}
            self.content.append(self.open)
            start = {"type": "text", "text": ""}
            out.append(
                {"type": "content_block_start", "index": len(self.content) - 1, "content_block": start}
            )
        self.open["text"] += delta
        out.append(
            {
                "type": "content_block_delta",
                "index": len(self.content) - 1,
                "delta": {"type": "text_delta", "text": delta},
            }
        )
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _tool_use(self, call: dict) -> list[dict]:
        out = self._close()
        self.pending = ""
        block = {
            "type": "tool_use",
            "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["name"],
            "input": {},
        }
        self.content.append(block)
        i = len(self.content) - 1
        out.append({"type": "content_block_start", "index": i, "content_block": dict(block)})
        out.append(
            {
                "type": "content_block_delta",
                "index": i,
                "delta": {"type": "input_json_delta", "partial_json": call["arguments"]},
            }
        )
        block["input"] = json.loads(call["arguments"])
        out.append({"type": "content_block_stop", "index": i})
        return out

    def _matched_stop(self, ev: Event) -> Optional[str]:
        """The stop sequence that ended the reply: the engine cuts it from the text, so it is found in
        the last tokens' own text."""
        if ev.finish_reason != "stop" or not self.stops:
            return None
        tail = "".join(self.token_text(ev.token_ids[-_STOP_TAIL_TOKENS:]))
        return next((s for s in self.stops if s in tail), None)

    def feed(self, ev: Event) -> list[dict]:
        self.last = ev
        out = self._text(ev.delta_text) if ev.delta_text else []
        for call in ev.tool_calls or []:
            out += self._tool_use(call)
        if ev.finished:
            if not self.content:
                out += self._text("", force=True)
            out += self._close()
            self.stop_sequence = self._matched_stop(ev)
            self.stop_reason = (
                "stop_sequence" if self.stop_sequence else _STOP.get(ev.finish_reason or "stop", "end_turn")
            )
            delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
            out.append(
                {"type": "message_delta", "delta": delta, "usage": {"output_tokens": ev.completion_tokens}}
            )
            out.append({"type": "message_stop"})
        return out


def sse_event(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'), ensure_ascii=False)}\n\n"
