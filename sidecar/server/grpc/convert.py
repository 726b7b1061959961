"""sidecar.v1 structured-output and tool-calling messages <-> the service's plain values."""

from __future__ import annotations

import json
from typing import Any, Optional

from sidecar.engine.structured import Constraint
from sidecar.server.structured_check import check_constraint
from sidecar.server.tools import ToolSpec
from sidecar.server.validation import invalid
from sidecar.v1 import sidecar_pb2 as pb

RF = pb.ResponseFormat
MODES = {
    pb.ToolChoice.MODE_UNSPECIFIED: "auto",
    pb.ToolChoice.MODE_AUTO: "auto",
    pb.ToolChoice.MODE_NONE: "none",
    pb.ToolChoice.MODE_REQUIRED: "required",
}


def _json_object(text: str, field: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise invalid(field, f"must be JSON text: {exc}") from None
    if not isinstance(obj, dict):
        raise invalid(field, "must be a JSON object")
    return obj


def response_format(msg: Any) -> Optional[Constraint]:
    """ResponseFormat -> Constraint (None for unset or TYPE_TEXT); ServiceError names the field."""
    if not msg.HasField("response_format"):
        return None
    rf = msg.response_format
    if rf.type == RF.TYPE_TEXT:
        return None
    if rf.type == RF.TYPE_JSON_OBJECT:
        return check_constraint(Constraint("json_object"), "response_format")
    if rf.type == RF.TYPE_JSON_SCHEMA:
        if len(rf.name) > 64:
            raise invalid("response_format.name", "at most 64 characters")
        if not rf.json_schema:
            raise invalid("response_format.json_schema", "required for TYPE_JSON_SCHEMA")
        schema = _json_object(rf.json_schema, "response_format.json_schema")
        return check_constraint(Constraint("json", schema, rf.strict), "response_format.json_schema")
    if rf.type == RF.TYPE_REGEX:
        if not rf.regex:
            raise invalid("response_format.regex", "required for TYPE_REGEX")
        return check_constraint(Constraint("regex", rf.regex), "response_format.regex")
    if rf.type == RF.TYPE_CHOICE:
        if not rf.choices or not all(rf.choices):
            raise invalid("response_format.choices", "at least one choice, each non-empty")
        return check_constraint(Constraint("choice", list(rf.choices)), "response_format.choices")
    raise invalid("response_format.type", f"unknown type {rf.type}")


def tools(msg: Any) -> dict[str, Any]:
    """ChatRequest tools / tool_choice / parallel_tool_calls -> GenerationRequest fields."""
    if not msg.tools and not msg.HasField("tool_choice"):
        return {}
    specs = tool_specs(msg.tools)
    tc = msg.tool_choice
    if tc.mode == pb.ToolChoice.MODE_FUNCTION:
        if not tc.function_name:
            raise invalid("tool_choice.function_name", "required for MODE_FUNCTION")
        choice = "function:" + tc.function_name
    elif tc.mode in MODES:
        choice = MODES[tc.mode] if specs or tc.mode != pb.ToolChoice.MODE_UNSPECIFIED else "none"
    else:
        raise invalid("tool_choice.mode", f"unknown mode {tc.mode}")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True
    return {"tools": specs, "tool_choice": choice, "parallel_tool_calls": parallel}


def reasoning_fields(msg: Any) -> dict[str, Any]:
    """ChatRequest chat_template_kwargs (JSON text) / reasoning_effort -> GenerationRequest fields."""
    out: dict[str, Any] = {}
    if msg.chat_template_kwargs:
        out["chat_template_kwargs"] = _json_object(msg.chat_template_kwargs, "chat_template_kwargs")
    if msg.reasoning_effort:
        out["reasoning_effort"] = msg.reasoning_effort
    return out


def tool_specs(tools_msg: Any) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(tools_msg):
        params = (
            _json_object(t.parameters, f"tools[{i}].parameters")
            if t.parameters
            else {"type": "object", "properties": {}}
        )
        specs.append(ToolSpec(t.name, t.description, params, t.strict))
    return specs


def messages(msgs: Any) -> list[dict]:
    out = []
    for m in msgs:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments or "{}"} for c in m.tool_calls
            ]
        if m.tool_call_id or m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.name and m.role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


def tool_calls(calls: list[dict]) -> list:
    return [
        pb.ToolCall(id=c["id"], type="function", name=c["name"], arguments=c["arguments"], index=c["index"])
        for c in calls
    ]
