"""Reasoning ("thinking") output of chat templates that emit ``<think>...</think>``, shared by both transports.

A template that writes a think block (Qwen3's, DeepSeek-R1's and their derivatives) makes the model put
its reasoning first, then the answer. The service splits the two apart as vLLM's reasoning parsers do:
``reasoning_content`` carries the text inside the block, ``content`` what follows it. Whether a model
thinks is read from its chat template (both markers appear in it); whether a reply starts inside a block
is read from the rendered prompt (a template that opens ``<think>`` in the generation prompt leaves the
model inside it).

``reasoning_effort`` (OpenAI's chat field) maps onto the template switch Qwen3 defines: "none" and
"minimal" render with ``enable_thinking=False``, "low", "medium" and "high" with ``enable_thinking=True``
(no token budget: the model decides how long it thinks). For a model that does not think the field is
accepted and changes nothing; the HTTP answer says so in ``x-sidecar-reasoning: unsupported``.
"""

from __future__ import annotations

import abc
import json
from typing import Any, Callable, Optional

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
REASONING_HEADER = "x-sidecar-reasoning"
MAX_TEMPLATE_KWARGS_CHARS = 4096
# Names the renderer itself passes; a caller's kwargs must not replace them.
_RESERVED_KWARGS = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "tokenize", "continue_final_message")
)

TokenText = Callable[[list[int]], list[str]]


def thinks(template: str) -> bool:
    """Whether a chat template writes think blocks (so replies carry reasoning to split off)."""
    return THINK_START in template and THINK_END in template


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict:
    """The caller's extra chat-template variables, checked: a JSON object of at most
    ``MAX_TEMPLATE_KWARGS_CHARS`` characters whose names are not the renderer's own. Raises
    ServiceError naming ``field``."""
    from sidecar.server.validation import invalid

    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid(field, "must be a JSON object")
    try:
        size = len(json.dumps(kwargs))
    except (TypeError, ValueError):
        raise invalid(field, "must be a JSON object") from None
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise invalid(field, f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON, got {size}")
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier() or k in _RESERVED_KWARGS:
            raise invalid(f"{field}.{k}", "not a template variable a request may set")
    return kwargs


def template_kwargs(kwargs: Optional[dict], effort: Optional[str], model_thinks: bool) -> dict:
    """The chat-template variables of a request: its ``chat_template_kwargs``, with ``enable_thinking``
    from ``reasoning_effort`` where the caller did not set it and the model thinks. Raises ServiceError
    naming ``reasoning_effort`` for a value OpenAI does not define."""
    from sidecar.server.validation import invalid

    out = check_template_kwargs(kwargs)
    if effort is None:
        return out
    if effort not in REASONING_EFFORTS:
        raise invalid("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    if model_thinks and "enable_thinking" not in out:
        out = dict(out, enable_thinking=effort not in ("none", "minimal"))
    return out


_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _answer_rules(c: Any) -> str:
    """Lark rules defining ``answer_`` as the constraint ``c`` (a ``structured.Constraint``)."""
    if c.kind in ("json", "json_object"):
        schema = c.value if c.kind == "json" else {"type": "object"}
        opts = dict(_GUIDANCE, lenient=not c.strict)
        return f"answer_: %json {json.dumps(dict(schema, **{'x-guidance': opts}))}\n"
    if c.kind == "regex":
        return "answer_: ANSWER_\nANSWER_: /" + c.value.replace("/", "\\/") + "/\n"
    if c.kind == "choice":
        return "answer_: " + " | ".join(json.dumps(x) for x in c.value) + "\n"
    lines = c.value.split("\n")  # a lark grammar: its start rule becomes answer_
    return (
        "\n".join("answer_:" + ln[len("start:") :] if ln.startswith("start:") else ln for ln in lines) + "\n"
    )


def needs_think_first(c: Any, opened: bool) -> bool:
    """Whether a thinking model's output constraint ``c`` gets the think block put before it: not when the
    constraint writes the block itself (a regex or grammar that mentions ``<think>`` shapes the whole
    reply), nor for a lazy tool grammar after a prompt that left the block closed (free text until a call
    starts, reasoning included)."""
    if c is None or THINK_START in str(c.value):
        return False
    return opened or not c.lazy_trigger


def think_first(c: Any, opened: bool) -> Any:
    """``c`` (an output constraint) for a thinking model: the think block first, unconstrained but for its
    end, then the answer under ``c``. ``opened``: the prompt opened the block, so the reply starts inside
    it and must close it; otherwise the block is optional (the model may answer at once). Returns a lark
    ``Constraint`` with ``c``'s flags (lazy trigger, end rules, strictness)."""
    import dataclasses

    # One lexeme runs through the end marker and the whitespace after it (the lexer never backtracks over
    # the marker): any text holding exactly one end marker, as its last non-blank text.
    head = "THINK_" if opened else '("<think>" THINK_)?'
    grammar = (
        f"start: {head} answer_\n"
        "THINK_: /(.|\\n)*<\\/think>[ \\t\\n]*/ & ~/(.|\\n)*<\\/think>(.|\\n)*<\\/think>(.|\\n)*/\n"
        + _answer_rules(c)
    )
    return dataclasses.replace(c, kind="lark", value=grammar)


def opens_block(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its last marker is an opening one)."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def _held(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class SplitStream(abc.ABC):
    """Streamed reply text split into reasoning and content: ``feed`` appends a piece to ``buf`` and lets the
    parser's ``_step`` consume what it can decide at the head of it, returning the deltas of both parts."""

    def __init__(self, token_text: TokenText) -> None:
        self.buf = ""
        self.reasoning = ""
        self.content = ""
        self.reasoning_tokens = 0  # set when the reply ends (count_tokens)
        self._token_text = token_text

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) of the next piece of the reply."""
        self.buf += delta
        r_out: list[str] = []
        c_out: list[str] = []
        while self._step(r_out, c_out):
            pass
        r, c = "".join(r_out), "".join(c_out)
        self.reasoning += r
        self.content += c
        return r, c

    @abc.abstractmethod
    def _step(self, r_out: list[str], c_out: list[str]) -> bool:
        """Consume what can be decided at the head of ``buf`` into the two outputs; False when more text is
        needed."""


class ReasoningParser(SplitStream):
    """Splits streamed reply text into reasoning and content.

    States: ``start`` (nothing but whitespace seen yet: a reply that begins with ``<think>`` reasons
    first), ``reasoning`` (inside the block, up to ``</think>``), ``content`` (everything after it, or the
    whole reply when it does not begin with a block). Text that may be the start of a marker is held
    back until it is known; whitespace between the block and the answer belongs to neither. A block the
    reply never closes (cut by max_tokens) is reasoning. ``count_tokens`` gives the generated tokens up
    to and including the one that completes ``</think>`` (all of them while the block is open)."""

    def __init__(self, opened: bool, token_text: TokenText) -> None:
        super().__init__(token_text)
        self.state = "reasoning" if opened else "start"
        self.entered = opened  # the reply has a think block
        self._gap = False  # right after the block: leading whitespace of the answer is dropped
        self.closed = False  # the reply's think block has ended

    def _step(self, r_out: list[str], c_out: list[str]) -> bool:
        """Consume what can be decided at the head of ``buf``; False when more text is needed."""
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(THINK_START):
                self.state, self.buf, self.entered = "reasoning", s[len(THINK_START) :], True
                return True
            if not s or THINK_START.startswith(s):
                return False
            self.state = "content"
            return True
        if self.state == "reasoning":
            i = self.buf.find(THINK_END)
            if i >= 0:
                r_out.append(self.buf[:i])
                self.state, self.buf, self._gap = "content", self.buf[i + len(THINK_END) :], True
                self.closed = True
                return True
            keep = _held(self.buf, THINK_END)
            r_out.append(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        if self._gap:
            self.buf = self.buf.lstrip()
            self._gap = not self.buf
        c_out.append(self.buf)
        self.buf = ""
        return False

    def count_tokens(self, ids: list[int]) -> int:
        """How many of the reply's tokens ``ids`` are reasoning: none without a block, all while it is open,
        else up to the one whose text completes the end marker (read a slice at a time)."""
        if not self.entered:
            return 0
        if not self.closed:
            return len(ids)
        text, k = "", 0
        for i in range(0, len(ids), 64):
            for s in self._token_text(ids[i : i + 64]):
                text, k = text + s, k + 1
                if THINK_END in text:
                    return k
        return len(ids)

    def finish(self) -> tuple[str, str]:
        """Flush what is held back at the end of the reply: (reasoning delta, content delta)."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            self.reasoning += rest
            return rest, ""
        if self.state == "start":  # never began a block: the text is the answer, as written
            self.state = "content"
        elif self._gap:
            rest = rest.lstrip()
        self.content += rest
        return "", rest


def split_event(ev: Any, parser: ReasoningParser) -> Any:
    """Move reasoning out of an event's text into ``ev.reasoning_*`` (in place); content stays in
    ``delta_text`` / ``text`` for the tool-call parser that may follow."""
    r, c = parser.feed(ev.delta_text)
    if ev.finished:
        r2, c2 = parser.finish()
        r, c = r + r2, c + c2
        parser.reasoning_tokens = parser.count_tokens(ev.token_ids)
    ev.delta_text, ev.text = c, parser.content
    ev.reasoning_delta, ev.reasoning_text = r, parser.reasoning
    ev.reasoning_tokens = parser.reasoning_tokens
    return ev
