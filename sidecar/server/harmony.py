"""The harmony reply format (gpt-oss): a reply is a run of messages, each a header and a body,
``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`` closed by ``<|end|>`` (more
follows: the next one opens with ``<|start|>assistant``), ``<|return|>`` (the reply is done) or ``<|call|>``
(a tool call). The ``analysis`` channel carries the model's reasoning, ``final`` the answer; ``commentary``
carries preambles to the user and tool calls (``to=functions.NAME``, JSON arguments).

``HarmonyParser`` splits streamed reply text (with special tokens kept, so the markers are in it) the way
``reasoning.ReasoningParser`` splits a think block: analysis bodies become ``reasoning_content``, the bodies
of the other channels the content; headers and markers belong to neither. A body addressed to
``functions.NAME`` and closed by ``<|call|>`` becomes a tool call (NAME, the body as its arguments) when
the request offers tools (``calls``); other bodies with a recipient, and calls a request did not ask for,
are left out. A reply that does not start with a header (a model answering in plain text) is content as
written. A call whose ``<|call|>`` is an end-of-sequence token of the model (gpt-oss's generation config
says so) never reaches the text: a reply that stops inside such a body holding one complete JSON value is
that call.

``tool_constraint`` holds a reply to a call where ``tool_choice`` is ``required`` or a named function: an
optional analysis message first (the reasoning stays free), an optional commentary preamble to the user
(free text, the reply's content), then one commentary message to ``functions.NAME`` of an allowed tool
whose body is JSON valid against that tool's parameters, closed by ``<|call|>``. Harmony ends the turn at
a call, so one call per reply.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Optional

from sidecar.engine.structured import Constraint
from sidecar.server import tools
from sidecar.server.reasoning import SplitStream
from sidecar.server.tool_formats import make_call
from sidecar.server.validation import invalid

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, CONSTRAIN = "<|end|>", "<|call|>", "<|constrain|>"
ENDS = (END, "<|return|>", CALL)
# the markers the call grammar writes; each is one special token in gpt-oss's tokenizer
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL)
FUNCTIONS = "functions."
REASONING_CHANNEL = "analysis"
# template variable the harmony templates read for the system message's "Reasoning: low|medium|high"
EFFORT_VARIABLE = "reasoning_effort"

TokenText = Callable[[list[int]], list[str]]


def is_harmony(template: str) -> bool:
    """Whether a chat template writes harmony messages (channel and message markers)."""
    return CHANNEL in template and MESSAGE in template


def template_kwargs(kwargs: dict, effort: Optional[str]) -> dict:
    """A harmony request's template variables: ``reasoning_effort`` "low", "medium" or "high" reaches the
    template's own variable unless the caller set it; "none" and "minimal" (no harmony level) leave the
    template's default."""
    if effort in ("low", "medium", "high") and EFFORT_VARIABLE not in kwargs:
        return dict(kwargs, **{EFFORT_VARIABLE: effort})
    return kwargs


def _text_through(marker: str, special: dict, name: str) -> tuple[str, str]:
    """(the rule body, its terminal's definition) of free text closed by ``marker``. A special-token marker
    is never text, so the text is any text; a marker spelled as text ends one lexeme that holds it once,
    as its end (the lexer never backtracks over the marker)."""
    if marker in special:
        return f"{name}? {tools._lit(marker, special)}", f"{name}: /(.|\\n)+/\n"
    m = re.escape(marker).replace("/", "\\/")
    return name, f"{name}: /(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/\n"


def tool_constraint(
    specs: list[tools.ToolSpec], tool_choice: str, response_format: Any, special: Optional[dict] = None
) -> Optional[Constraint]:
    """The output constraint of a harmony chat request with tools; None (free channels) under ``auto``
    or ``none``. ``special``: the ``MARKERS`` that are single special tokens -> their ids. Under
    ``required`` or ``function:NAME`` the reply is an optional analysis message and an optional
    preamble, then one call to an allowed tool (module docstring); an output format cannot be combined
    with it (the call is the answer)."""
    if not specs or tool_choice in ("auto", "none"):
        return None
    if response_format is not None:
        raise invalid(
            "response_format",
            "cannot be combined with tool_choice required or a named function (the calls are the answer)",
        )
    special = special or {}
    if tool_choice.startswith("function:"):
        specs = [t for t in specs if t.name == tool_choice[len("function:") :]]
    opts = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": not any(t.strict for t in specs),
    }
    lit = {m: tools._lit(m, special) for m in MARKERS}
    text, text_rule = _text_through(END, special, "ANALYSIS_")
    said, said_rule = _text_through(END, special, "PREAMBLE_")
    # "commentary" is one lexeme shared by the preamble and the call, so no literal is a prefix of another
    comm = f'{lit[CHANNEL]} "commentary"'
    lines = [
        "start: analysis_? call_",
        f'analysis_: {lit[CHANNEL]} "analysis" {lit[MESSAGE]} {text} {lit[START]} "assistant"',
        text_rule.rstrip("\n"),
        f"call_: {comm} (preamble_ {comm})? ({' | '.join(f'to_{i}' for i in range(len(specs)))})",
        f'preamble_: {lit[MESSAGE]} {said} {lit[START]} "assistant"',
        said_rule.rstrip("\n"),
    ]
    for i, t in enumerate(specs):
        schema = dict(tools.close_objects(t.parameters), **{"x-guidance": opts})
        head = json.dumps(f" to={FUNCTIONS}{t.name} ")
        lines.append(f'to_{i}: {head} {lit[CONSTRAIN]} "json" {lit[MESSAGE]} body_{i} {lit[CALL]}')
        lines.append(f"body_{i}: %json {json.dumps(schema)}")
    return Constraint("lark", "\n".join(lines) + "\n", open_end=True)


def chat_params(req: Any, special: dict) -> Any:
    """The request's SamplingParams with ``tool_constraint`` folded into ``structured`` where its
    ``tool_choice`` forces a call (checked, naming ``tools``); otherwise its own."""
    if not tools.uses_tools(req) or req.tool_choice == "auto":
        return req.params
    from sidecar.server.structured_check import check_constraint

    c = tool_constraint(req.tools, req.tool_choice, req.params.structured, special)
    return dataclasses.replace(req.params, structured=check_constraint(c, "tools"))


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest proper prefix of any of ``markers`` that ``text`` ends with."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class HarmonyParser(SplitStream):
    """Splits streamed harmony text into reasoning and content (``ReasoningParser``'s interface).

    States: ``header`` (between messages: text up to ``<|message|>`` names the channel and recipient),
    ``body`` (a message's text up to its end marker, reasoning or content by its channel, dropped when it
    has a recipient), ``plain`` (the reply began without a header: all of it is content)."""

    def __init__(self, token_text: TokenText, calls: bool = False) -> None:
        super().__init__(token_text)
        self.state = "header"
        self.channel: Optional[str] = None  # the current (or last) message's channel
        self.recipient: Optional[str] = None
        self._offers_calls = calls
        self.calls: list[dict] = []  # every tool call of the reply so far
        self._new: list[dict] = []  # those not yet taken (take_calls)
        self._body = ""  # the current body addressed to a recipient

    def take_calls(self) -> list[dict]:
        """The tool calls completed since the last take."""
        new, self._new = self._new, []
        return new

    def _header(self, head: str) -> None:
        """The channel and recipient a message header names (``<|start|>assistant`` before it ignored)."""
        at = head.find(CHANNEL)
        words = head[at + len(CHANNEL) :].replace("<|", " <|").split() if at >= 0 else []
        self.channel = words[0] if words else None
        self.recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        if self.recipient is None and " to=" in head[: max(at, 0)]:  # the recipient before the channel
            self.recipient = head.split(" to=", 1)[1].split()[0]

    def _step(self, r_out: list[str], c_out: list[str]) -> bool:
        """Consume what can be decided at the head of ``buf``; False when more text is needed."""
        if self.state == "plain":
            c_out.append(self.buf)
            self.buf = ""
            return False
        if self.state == "header":
            s = self.buf.lstrip()
            fresh = not self.reasoning and not self.content and self.channel is None
            if fresh and s and not s.startswith("<|") and not "<|".startswith(s):
                self.state = "plain"
                return True
            i = self.buf.find(MESSAGE)
            if i < 0:
                return False
            self._header(self.buf[:i])
            self.state, self.buf = "body", self.buf[i + len(MESSAGE) :]
            return True
        ends = [(j, m) for m in ENDS if (j := self.buf.find(m)) >= 0]
        if ends:
            j, m = min(ends)
            self._emit(self.buf[:j], r_out, c_out)
            if m == CALL:
                self._call()
            self.state, self.buf, self._body = "header", self.buf[j + len(m) :], ""
            return True
        keep = _held(self.buf, ENDS)
        self._emit(self.buf[: len(self.buf) - keep], r_out, c_out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _call(self) -> None:
        """The current body becomes a call when it is addressed to a function the request may call."""
        if self._offers_calls and (self.recipient or "").startswith(FUNCTIONS):
            name = self.recipient[len(FUNCTIONS) :]
            call = make_call({"name": name, "arguments": self._body}, len(self.calls))
            self.calls.append(call)
            self._new.append(call)

    def stopped(self) -> None:
        """The reply stopped on an end token (after ``finish``): a call body left open holding one complete
        JSON value was closed by ``<|call|>`` as an end-of-sequence token, so it is that call."""
        if self.state != "body" or self.recipient is None:
            return
        try:
            json.loads(self._body)
        except ValueError:
            return
        self._call()
        self.state, self._body = "header", ""

    def _emit(self, text: str, r_out: list[str], c_out: list[str]) -> None:
        if self.recipient is not None:
            self._body += text
            return
        (r_out if self.channel == REASONING_CHANNEL else c_out).append(text)

    def count_tokens(self, ids: list[int]) -> int:
        """How many of the reply's tokens ``ids`` belong to analysis messages (their headers, bodies and end
        markers), read a slice at a time through a parser of their own."""
        if not self.reasoning and self.channel != REASONING_CHANNEL:
            return 0
        probe, n = HarmonyParser(self._token_text), 0
        for i in range(0, len(ids), 64):
            for s in self._token_text(ids[i : i + 64]):
                before = probe.channel if probe.state == "body" else None
                r, _ = probe.feed(s)
                after = probe.channel if probe.state == "body" else None
                n += bool(r) or REASONING_CHANNEL in (before, after)
        return n

    def finish(self) -> tuple[str, str]:
        """Flush what is held back at the end of the reply: (reasoning delta, content delta). A body cut
        short (max_tokens) keeps its channel's side; an unfinished header is dropped."""
        rest, self.buf = self.buf, ""
        r_out: list[str] = []
        c_out: list[str] = []
        if self.state == "body":
            self._emit(rest, r_out, c_out)
        elif self.state == "plain" or (self.state == "header" and self.channel is None and "<|" not in rest):
            c_out.append(rest)
        r, c = "".join(r_out), "".join(c_out)
        self.reasoning += r
        self.content += c
        return r, c


def split_calls(ev: Any, parser: HarmonyParser) -> Any:
    """The tool calls a harmony reply completed in this event into ``ev.tool_calls`` (in place); a reply
    that stops after calls finishes with ``tool_calls``."""
    if ev.finished and ev.finish_reason == "stop":
        parser.stopped()
    ev.tool_calls = parser.take_calls()
    if ev.finished and parser.calls and ev.finish_reason == "stop":
        ev.finish_reason = "tool_calls"
    return ev
