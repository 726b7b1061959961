"""Tool calling shared by both transports: validation, prompt rendering, the call grammar, parsing.

Wire convention (the default template's, and Qwen2.5 / Hermes-style templates'): the model
writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The grammar
built here and the parser below agree on exactly that text, so with ``tool_choice`` required
or a named function every call parses and its arguments match the tool's schema. Under
``auto`` the grammar is lazy: free text costs no masks until a call may be starting.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from sidecar.engine.structured import Constraint
from sidecar.server.tool_formats import (
    HERMES,
    ToolFormat,
    TrailingCallParser,
    detect,
    make_call,
    tools_in_system,
)
from sidecar.server.validation import invalid

if TYPE_CHECKING:
    from sidecar.engine.async_engine import AsyncEngine

CALL_START = HERMES.start
CALL_END = HERMES.end
MAX_TOOLS = 128
# Most calls in one reply. Small models given "one or more" repeat a call until max_tokens; a bound
# ends the turn whatever the model does (one call with parallel_tool_calls false or a named function).
MAX_PARALLEL_CALLS = 4
# An unset max_tokens under tool_choice required / named is this per allowed call: enough for the
# arguments of any sensible call, far below the rest of the context a runaway reply would otherwise take.
TOKENS_PER_CALL = 1024
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False


def check_tools(tools: Any, tool_choice: Any) -> None:
    """Raise ServiceError naming the field for a bad tool list or tool choice."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"must be a list of at most {MAX_TOOLS} tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, ToolSpec) or not isinstance(t.name, str) or not _NAME.match(t.name):
            raise invalid(f"tools[{i}].name", "must match [A-Za-z0-9_-]{1,64}")
        if t.name in seen:
            raise invalid(f"tools[{i}].name", f"duplicate tool name {t.name!r}")
        seen.add(t.name)
        if not isinstance(t.parameters, dict):
            raise invalid(f"tools[{i}].parameters", "must be a JSON schema object")
    if tool_choice in TOOL_CHOICES:
        if tool_choice == "required" and not tools:
            raise invalid("tool_choice", "'required' needs at least one tool")
        return
    if not isinstance(tool_choice, str) or not tool_choice.startswith("function:"):
        raise invalid("tool_choice", f"must be none, auto, required or a function, got {tool_choice!r}")
    name = tool_choice[len("function:") :]
    if name not in seen:
        raise invalid("tool_choice", f"names the function {name!r}, which is not in tools")


def tools_key(tools: Optional[list[ToolSpec]], tool_choice: str, parallel: bool) -> str:
    """Canonical text of the tool setup for cache keys ('' without tools)."""
    if not tools or tool_choice == "none":
        return ""
    return json.dumps(
        [[t.name, t.description, t.parameters, t.strict] for t in tools] + [tool_choice, parallel],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


# -- the grammar ------------------------------------------------------------------------------------
_SUBSCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of ``schema`` where every object schema that does not say ``additionalProperties`` allows
    only its declared properties (as with vLLM's default grammar backend): clients' generated schemas
    (Pydantic, LangChain, LiteLLM) rarely say it, and an open object lets a model invent properties
    until max_tokens. ``additionalProperties: true`` keeps an object open. Members of an ``allOf`` are
    left open: each declares only part of the object."""
    if isinstance(schema, list):
        return [close_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_KEYS:
        if k in out:
            out[k] = close_objects(out[k])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [close_objects(x) for x in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(x, in_all_of=True) for x in out["allOf"]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: close_objects(sub) for name, sub in out[k].items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and not in_all_of and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def default_tool_max_tokens(tool_choice: str, parallel: bool) -> Optional[int]:
    """The max_tokens of a request with tools that did not set one; None: the rest of the context."""
    if tool_choice in ("none", "auto"):
        return None
    return TOKENS_PER_CALL * (MAX_PARALLEL_CALLS if parallel and tool_choice == "required" else 1)


def _call_schema(tools: list[ToolSpec], args_key: str = "arguments") -> dict:
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: close_objects(t.parameters)},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _lit(marker: str, special: Optional[dict]) -> str:
    """A marker in lark: the special token itself when it is one (its text would be spelled in pieces)."""
    tid = (special or {}).get(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker)


def _calls_rules(tools: list[ToolSpec], parallel: bool, fmt: ToolFormat, special: Optional[dict], opts: dict):
    """(rules defining ``calls`` and ``body``, the ``more`` suffix of the first call) for a format."""
    n = MAX_PARALLEL_CALLS if parallel else 1
    if fmt.array:  # one JSON array of calls after the marker
        arr = {"type": "array", "items": _call_schema(tools, fmt.args_key), "minItems": 1, "maxItems": n}
        body = f"body: %json {json.dumps(dict(arr, **{'x-guidance': opts}))}\n"
        return f'calls: {_lit(fmt.start, special)} " "? body\n{body}', ""
    sep = json.dumps(fmt.separator)
    more = "".join(f" ({sep} call" for _ in range(n - 1)) + ")?" * (n - 1)
    if fmt.end and parallel:
        more += f" {sep}?"
    body = f"body: %json {json.dumps(dict(_call_schema(tools, fmt.args_key), **{'x-guidance': opts}))}\n"
    if fmt.end:
        call = f"call: {_lit(fmt.start, special)} body {_lit(fmt.end, special)}\n"
        return f"calls: call{more}\n{call}{body}", more
    tag = f"{_lit(fmt.start, special)}? " if fmt.start else ""
    return f"calls: {tag}call{more}\ncall: body\n{body}", more


def _auto_grammar(rules: str, more: str, fmt: ToolFormat, special: Optional[dict]) -> tuple[str, str]:
    """(grammar, lazy trigger) of tool_choice auto: free text, or text up to the first call marker followed
    by the calls (calls that lead the reply, for formats without a required marker)."""
    if not fmt.start or fmt.optional_start:  # the reply is text not starting with "{", or the calls
        text = "/[ \\t\\n]*[^{ \\t\\n](.|\\n)*/"
        if fmt.start and fmt.start not in (special or {}):
            esc = re.escape(fmt.start).replace("/", "\\/")
            text += f" & ~/[ \\t\\n]*{esc}(.|\\n)*/"
        return f"start: TEXT | calls\nTEXT: {text}\n{rules}", "{"
    gap = ' " "?' if fmt.array else ""  # an array may follow its marker after a space
    end = f" {_lit(fmt.end, special)}" if fmt.end else ""
    first = f"{_lit(fmt.start, special)}{gap} body{end}"
    if fmt.start in (special or {}):  # a special token is never text: text, then the marker token
        return f"start: TEXT | TEXT? {first}{more}\nTEXT: /(.|\\n)+/\n{rules}", fmt.start
    # Free text that never contains the marker, or such text up to the first marker followed by the calls.
    # Each is one lexeme, so the lexer never has to backtrack over the marker. Lazy: the text costs no
    # masks until a marker may be forming.
    m = re.escape(fmt.start).replace("/", "\\/")
    grammar = (
        f"start: TEXT | PRE_CALL{gap} body{end}{more}\n"
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{m}(.|\\n)*/\n"
        f"PRE_CALL: /(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/\n{rules}"
    )
    return grammar, fmt.start


def tool_constraint(
    tools: list[ToolSpec],
    tool_choice: str,
    parallel: bool,
    response_format: Optional[Constraint],
    fmt: ToolFormat = HERMES,
    special: Optional[dict] = None,
) -> Optional[Constraint]:
    """The output constraint for a chat request with tools in the model's format ``fmt``; None means free
    text. ``special``: markers of ``fmt`` that are single special tokens -> their ids.

    Calls follow each other, the format's separator apart, up to ``MAX_PARALLEL_CALLS`` (one without
    parallel calls or with a named function). The end of the turn is the model's own choice: where the
    grammar may end (after each complete call), the model samples unmasked and anything but the start of
    another call ends the turn (``open_end``); a call that repeats an earlier one ends it too, and is
    dropped by the parser (``end_on_repeat``)."""
    if not tools or tool_choice == "none":
        return response_format
    if tool_choice != "auto" and response_format is not None:
        raise invalid(
            "response_format",
            "cannot be combined with tool_choice required or a named function (the calls are the answer)",
        )
    if tool_choice.startswith("function:"):
        tools = [t for t in tools if t.name == tool_choice[len("function:") :]]
        parallel = False
    strict = any(t.strict for t in tools)
    opts = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": not strict,
    }
    rules, more = _calls_rules(tools, parallel, fmt, special, opts)
    if tool_choice != "auto":
        return Constraint("lark", f"start: calls\n{rules}", open_end=True, end_on_repeat=True)
    if response_format is not None:
        if response_format.kind not in ("json", "json_object"):
            raise invalid(
                "response_format", "only JSON formats can be combined with tools under tool_choice auto"
            )
        fmt_schema = response_format.value if response_format.kind == "json" else {"type": "object"}
        fmt_opts = dict(opts, lenient=not response_format.strict)
        return Constraint(
            "lark",
            f"start: answer | calls\nanswer: %json {json.dumps(dict(fmt_schema, **{'x-guidance': fmt_opts}))}\n"
            + rules,
            open_end=True,
            end_on_repeat=True,
        )
    grammar, trigger = _auto_grammar(rules, more, fmt, special)
    return Constraint("lark", grammar, lazy_trigger=trigger, open_end=True)


# -- rendering -------------------------------------------------------------------------------------
def _openai_tool(t: ToolSpec) -> dict:
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


def default_tools_block(tools: list[ToolSpec], fmt: ToolFormat = HERMES) -> str:
    """The system text that lists the tools for a model whose chat template cannot (docs/API.md)."""
    lines = [
        "You can call functions. To call one, reply with exactly",
        fmt.example(),
        "and nothing else. Available functions (JSON):",
    ]
    lines += [json.dumps(_openai_tool(t)["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def _calls_text(calls: list[dict], fmt: ToolFormat = HERMES) -> str:
    """Earlier calls of the conversation written as the model writes them."""
    objs = [{"name": c["name"], fmt.args_key: _args_obj(c.get("arguments") or "{}")} for c in calls]
    texts = [json.dumps(o, ensure_ascii=False) for o in objs]
    if fmt.array:
        return fmt.start + "[" + ", ".join(texts) + "]"
    if not fmt.end:
        return fmt.start + fmt.separator.join(texts)
    return "".join(fmt.start + t + fmt.end for t in texts)


def render_messages(
    messages: list[dict],
    tools: Optional[list[ToolSpec]],
    template_has_tools: bool,
    fmt: ToolFormat = HERMES,
    system_tools: bool = False,
) -> tuple[list[dict], Optional[list[dict]]]:
    """Messages (with tool calls and tool results) -> (template messages, template tools or None).

    A template that renders tools gets them and the structured messages as Hugging Face defines
    them; otherwise calls/results become plain text in the model's format ``fmt``, and tools either go
    to the system message's ``tools`` field (``system_tools``: a template that reads them there) or
    become a system block."""
    if template_has_tools:
        out = []
        for m in messages:
            m2 = {"role": m["role"], "content": m.get("content") or ""}
            if m.get("tool_calls"):
                m2["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {"name": c["name"], "arguments": _args_obj(c.get("arguments"))},
                    }
                    for c in m["tool_calls"]
                ]
            if m["role"] == "tool":
                m2["tool_call_id"] = m.get("tool_call_id")
                if m.get("name"):
                    m2["name"] = m["name"]
            out.append(m2)
        return out, ([_openai_tool(t) for t in tools] if tools else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
            )
        elif m.get("tool_calls"):
            out.append(
                {"role": "assistant", "content": (m.get("content") or "") + _calls_text(m["tool_calls"], fmt)}
            )
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        if not (out and out[0]["role"] == "system"):
            out.insert(0, {"role": "system", "content": ""})
        if system_tools:
            specs = [_openai_tool(t)["function"] for t in tools]
            out[0] = dict(out[0], tools=json.dumps(specs, ensure_ascii=False))
        else:
            block = default_tools_block(tools, fmt)
            head = out[0]["content"]
            out[0] = {"role": "system", "content": head + "\n\n" + block if head else block}
    return out, None


def _args_obj(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}


# -- parsing ---------------------------------------------------------------------------------------
_JSON = json.JSONDecoder()


class ToolCallParser:
    """Splits streamed text into content deltas and complete tool calls.

    A call is read by the grammar's structure -- the start marker, one complete JSON value, the end
    marker -- never by searching for the end marker, so an argument that contains the end marker's
    text (copied from data) stays inside its string. Text that may be the start of a call marker is
    held back until it is known not to be one; a call is emitted whole once its end marker follows
    the JSON value. ``finish`` flushes what is left (an unterminated call, e.g. cut by max_tokens, is
    returned as content).

    A call equal to an earlier one of the reply (same name, same arguments as JSON values) ends the
    reply: it is dropped with everything after it (the grammar's ``end_on_repeat`` stops generation
    right there). Small models otherwise repeat their call, and a repeat tells the caller nothing new."""

    def __init__(self, fmt: ToolFormat = HERMES) -> None:
        self.start, self.end, self.args_key = fmt.start, fmt.end, fmt.args_key
        self.late: list[dict] = []  # calls found only at the end (never, for this format)
        self.buf = ""
        self.in_call = False
        self.calls: list[dict] = []
        self.content = ""
        self.ended = False  # a repeated call ended the reply: later text is dropped
        self.gap = False  # right after a call, until something other than whitespace follows
        self._seen: set[str] = set()

    def _take_call(self, out: list[str], new: list[dict]) -> bool:
        """Consume a call body at the head of ``buf`` if complete; False while more text is needed."""
        if "}" not in self.buf:
            return False  # a call body is a JSON object: nothing is complete before its closing brace
        try:
            obj, end = _JSON.raw_decode(self.buf)
        except ValueError:
            return False  # incomplete so far (the grammar only lets valid JSON through)
        rest = self.buf[end:]
        if len(rest) < len(self.end) and self.end.startswith(rest):
            return False
        call = make_call(obj, len(self.calls), self.args_key) if rest.startswith(self.end) else None
        if call is None:  # not a call after all: it stays text
            out.append(self.start + self.buf[:end])
            self.buf, self.in_call = rest, False
            return True
        key = json.dumps([obj["name"], obj.get(self.args_key, {})], sort_keys=True, ensure_ascii=False)
        if key in self._seen:  # a repeat ends the reply
            self.buf, self.in_call, self.ended = "", False, True
            return False
        self._seen.add(key)
        self.gap = True
        self.calls.append(call)
        new.append(call)
        self.buf, self.in_call = rest[len(self.end) :], False
        return True

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self.ended:
            return "", []
        self.buf += delta
        out: list[str] = []
        new: list[dict] = []
        while True:
            if not self.in_call and self.gap:  # whitespace right after a call separates calls: not content
                self.buf = self.buf.lstrip()
                self.gap = not self.buf
            if not self.in_call:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = next(
                        (
                            k
                            for k in range(min(len(self.start) - 1, len(self.buf)), 0, -1)
                            if self.buf.endswith(self.start[:k])
                        ),
                        0,
                    )
                    out.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                out.append(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(self.start) :], True
            if not self._take_call(out, new):
                break
        text = "".join(out)
        self.content += text
        return text, new

    def finish(self) -> str:
        rest = (self.start if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        self.content += rest
        return rest


def make_parser(fmt: ToolFormat = HERMES) -> Any:
    """The streaming parser of ``fmt``: ToolCallParser for calls between markers, TrailingCallParser for
    calls that run to the end of the reply. Both have feed / finish / content / calls / late."""
    return ToolCallParser(fmt) if fmt.end else TrailingCallParser(fmt)


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES) -> tuple[str, list[dict]]:
    """Whole text -> (content without call markup, calls)."""
    p = make_parser(fmt)
    p.feed(text)
    p.finish()
    return p.content, p.calls


# -- the service's chat step ------------------------------------------------------------------------
def uses_tools(req: Any) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def chat_prompt(engine: AsyncEngine, req: Any, template_kwargs: Optional[dict] = None) -> list[int]:
    """Render a chat request's messages (and tools) with the model's template, or the default one;
    ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``)."""
    has_tool_messages = any(m["role"] == "tool" or m.get("tool_calls") for m in req.messages)
    tools = req.tools if uses_tools(req) else None
    if not tools and not has_tool_messages:
        return engine.encode_chat(req.messages, None, template_kwargs)
    template = engine.chat_template
    fmt = detect(template)
    msgs, tpl_tools = render_messages(
        req.messages,
        tools,
        "tools" in template and "tool_calls" in template,
        fmt,
        tools_in_system(fmt, template),
    )
    return engine.encode_chat(msgs, tpl_tools, template_kwargs)


def chat_params(req: Any, fmt: ToolFormat = HERMES, special: Optional[dict] = None) -> Any:
    """The request's SamplingParams with the tool-call grammar of format ``fmt`` folded into ``structured``
    (``special``: its markers that are single special tokens -> ids; the reply then keeps special tokens
    in its text, so the parser sees them)."""
    if not uses_tools(req):
        return req.params
    import dataclasses

    from sidecar.server.structured_check import check_constraint

    c = tool_constraint(
        req.tools, req.tool_choice, req.parallel_tool_calls, req.params.structured, fmt, special
    )
    kw = {"skip_special_tokens": False} if special else {}
    return dataclasses.replace(req.params, structured=check_constraint(c, "tools"), **kw)


def split_event(ev: Any, parser: Any) -> Any:
    """Move tool-call markup out of an event's text into ``ev.tool_calls`` (in place)."""
    delta, calls = parser.feed(ev.delta_text)
    if ev.finished:
        delta += parser.finish()
        calls = calls + parser.late
        if parser.calls and ev.finish_reason == "stop":
            ev.finish_reason = "tool_calls"
    ev.delta_text, ev.text, ev.tool_calls = delta, parser.content, calls
    return ev
