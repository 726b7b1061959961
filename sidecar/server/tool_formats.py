"""How each model family writes tool calls, chosen from its chat template, and the parser of the formats
whose calls run to the end of the reply.

Formats (``ToolFormat``), as the families' own templates and tokenizers define them:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  per call, calls a newline apart.
- ``phi4`` (Phi-4-mini): the same shape between ``<|tool_call|>`` and ``<|/tool_call|>``; its template takes
  the tool list as JSON text in the system message's ``tools`` field.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the reply is the calls, each ``{"name": ..., "parameters": {...}}``,
  separated by ``; ``; where the template knows ``<|python_tag|>`` the calls may follow it.
- ``mistral``: ``[TOOL_CALLS]`` followed by one JSON array of ``{"name": ..., "arguments": {...}}``.

A marker that is one special token of the tokenizer is written in grammars as that token (``<[id]>``), not
as its text (which the tokenizer would spell in pieces), and requests then keep special tokens in their
text so the parser sees the marker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the text that opens a call (each call, or the whole list when ``end`` is empty)
    end: str  # the text that closes each call; "" when the calls run to the end of the reply
    args_key: str  # "arguments" or "parameters"
    array: bool = False  # the calls are one JSON array after ``start``
    separator: str = "\n"  # between calls
    optional_start: bool = False  # ``start`` may be left out (the reply then begins with the calls)

    def example(self) -> str:
        """One call written in this format, for a system prompt that teaches it."""
        body = f'{{"name": <function name>, "{self.args_key}": <arguments as a JSON object>}}'
        return self.start + (f"[{body}]" if self.array else body) + self.end


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
PHI4 = ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", "arguments")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", array=True, separator=", ")
LLAMA3 = ToolFormat("llama3_json", "", "", "parameters", separator="; ")
LLAMA3_TAG = ToolFormat(
    "llama3_json", "<|python_tag|>", "", "parameters", separator="; ", optional_start=True
)


def detect(template: str) -> ToolFormat:
    """The tool-call format a chat template uses (hermes when it shows none of the others)."""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|tool_call|>" in template or "<|tool|>" in template:
        return PHI4
    if "<|start_header_id|>" in template and ('"parameters"' in template or "<|python_tag|>" in template):
        return LLAMA3_TAG if "<|python_tag|>" in template else LLAMA3
    return HERMES


def tools_in_system(fmt: ToolFormat, template: str) -> bool:
    """Whether the template reads the tool list from the system message's ``tools`` field (Phi-4-mini)."""
    return fmt is PHI4 and ("message['tools']" in template or "message.tools" in template)


def make_call(obj: Any, index: int, args_key: str = "arguments") -> Optional[dict]:
    """A parsed call object -> the service's call dict; None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "name": obj["name"],
        "arguments": json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args,
        "index": index,
    }


def _objects(text: str, fmt: ToolFormat) -> Optional[list]:
    """The call objects of a trailing-calls text, or None when it is not exactly calls."""
    if fmt.array:
        try:
            obj, end = _JSON.raw_decode(text.strip())
        except ValueError:
            return None
        if text.strip()[end:].strip():
            return None
        return obj if isinstance(obj, list) else [obj]
    objs, pos, s = [], 0, text.strip()
    while pos < len(s):
        try:
            obj, pos = _JSON.raw_decode(s, pos)
        except ValueError:
            return None
        objs.append(obj)
        while pos < len(s) and s[pos] in " \t\n;":
            pos += 1
    return objs or None


class TrailingCallParser:
    """Content and calls of formats whose calls run to the end of the reply (``llama3_json``, ``mistral``).

    Text streams as content until the calls begin: at ``start`` (anywhere for a format with a required
    marker), or, where the marker is optional, at a reply that begins with ``{``. From there the text is
    held and parsed when the reply ends (``finish``): the calls land in ``late``; text that is not exactly
    calls is returned as content. A call equal to an earlier one ends the list (the rest is dropped)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.in_calls = False
        self.prefix = ""  # the marker that opened the calls ("" for a reply that began with them)
        self.begun = False  # content has begun: calls can no longer lead the reply
        self.calls: list[dict] = []
        self.late: list[dict] = []  # calls found by ``finish``
        self.content = ""

    def _enter(self, rest: str, prefix: str) -> None:
        self.buf, self.prefix, self.in_calls = rest, prefix, True

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        if self.in_calls:
            return "", []
        start = self.fmt.start
        if not start or self.fmt.optional_start:  # calls can only lead the reply
            if not self.begun:
                s = self.buf.lstrip()
                if start and s.startswith(start):
                    self._enter(s[len(start) :], start)
                    return "", []
                if s.startswith("{"):
                    self._enter(s, "")
                    return "", []
                if not s or (start and start.startswith(s)):
                    return "", []  # not decided yet
                self.begun = True
            out, self.buf = self.buf, ""
        else:
            i = self.buf.find(start)
            if i >= 0:
                out = self.buf[:i]
                self._enter(self.buf[i + len(start) :], start)
            else:
                keep = next(
                    (
                        k
                        for k in range(min(len(start) - 1, len(self.buf)), 0, -1)
                        if self.buf.endswith(start[:k])
                    ),
                    0,
                )
                out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        self.content += out
        return out, []

    def finish(self) -> str:
        rest, self.buf = self.buf, ""
        if not self.in_calls:
            self.content += rest
            return rest
        calls, seen = [], set()
        for obj in _objects(rest, self.fmt) or []:
            call = make_call(obj, len(calls), self.fmt.args_key)
            if call is None:
                calls = []
                break
            key = json.dumps(
                [obj["name"], obj.get(self.fmt.args_key, {})], sort_keys=True, ensure_ascii=False
            )
            if key in seen:
                break  # a repeat ends the list
            seen.add(key)
            calls.append(call)
        if not calls:  # not calls after all: the text stays content
            text = self.prefix + rest
            self.content += text
            return text
        self.calls, self.late = calls, calls
        return ""
