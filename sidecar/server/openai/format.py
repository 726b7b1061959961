"""OpenAI response and chunk bodies built from service ``Event``s.

Pure functions over plain dicts: no I/O, no service calls except the
``token_text`` callback that turns token ids into strings for logprobs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

TokenText = Callable[[list[int]], list[str]]
# JSON has no -inf; a token the model rules out gets this floor (what vLLM reports too).
LOGPROB_FLOOR = -9999.0


def now() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _lp(x: float) -> float:
    return LOGPROB_FLOOR if x is None or math.isnan(x) or x < LOGPROB_FLOOR else float(x)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens:  # a thinking model's reply: the part of completion_tokens spent reasoning
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def cache_header(statuses: list[str]) -> str:
    """One value for the whole call: hit only when every choice was answered from the cache."""
    if statuses and all(s.startswith("hit") for s in statuses):
        return "hit"
    if any(s == "miss" for s in statuses):
        return "miss"
    return "bypass"


COALESCED_HEADER = "x-sidecar-coalesced"


def coalesced_header(flags: list[bool]) -> dict:
    """``x-sidecar-coalesced: true`` when every choice followed an identical in-flight generation."""
    return {COALESCED_HEADER: "true"} if flags and all(flags) else {}


def chat_logprobs(lps: list[Any], token_text: TokenText) -> dict:
    """``choices[].logprobs`` of a chat completion for engine TokenLogprob entries."""
    ids = [lp.token_id for lp in lps] + [t for lp in lps for t, _ in lp.top]
    names = dict(zip(ids, token_text(ids))) if ids else {}

    def entry(tid: int, logprob: float) -> dict:
        s = names[tid]
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps
        ]
    }


def completion_logprobs(lps: list[Any], token_text: TokenText, text_offset: int) -> dict:
    """Legacy ``choices[].logprobs`` of a text completion; offsets count from ``text_offset``."""
    ids = [lp.token_id for lp in lps] + [t for lp in lps for t, _ in lp.top]
    names = dict(zip(ids, token_text(ids))) if ids else {}
    tokens, offsets = [], []
    pos = text_offset
    for lp in lps:
        s = names[lp.token_id]
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(lp.logprob) for lp in lps],
        "top_logprobs": [{names[t]: _lp(v) for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


@dataclass
class ChoiceState:
    """What one choice has produced so far (the service's events are cumulative in text)."""

    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_status: str = "bypass"
    coalesced: bool = False
    started: bool = False  # a chunk was already sent for this choice (chat: the role delta)
    tool_calls: list = field(default_factory=list)
    reasoning: str = ""  # a thinking model's reasoning so far (message.reasoning_content)
    reasoning_tokens: int = 0

    def update(self, ev: Any) -> None:
        self.text = ev.text
        self.reasoning = getattr(ev, "reasoning_text", "")
        self.reasoning_tokens = getattr(ev, "reasoning_tokens", 0)
        self.tool_calls.extend(getattr(ev, "tool_calls", None) or [])
        if ev.new_logprobs:
            self.logprobs.extend(ev.new_logprobs)
        self.prompt_tokens = ev.prompt_tokens
        self.completion_tokens = ev.completion_tokens
        self.cached_tokens = ev.cached_tokens
        self.cache_status = ev.cache.status
        self.coalesced = bool(getattr(ev.cache, "coalesced", False))
        if ev.finished:
            self.finish_reason = ev.finish_reason


def total_usage(states: list[ChoiceState], choices_per_prompt: int) -> dict:
    """Prompt tokens count once per prompt (as OpenAI bills n > 1); completions add up."""
    firsts = states[::choices_per_prompt]
    return usage(
        sum(s.prompt_tokens for s in firsts),
        sum(s.completion_tokens for s in states),
        sum(s.cached_tokens for s in firsts),
        sum(s.reasoning_tokens for s in states),
    )


def chat_response(
    rid: str,
    model: str,
    created: int,
    states: list[ChoiceState],
    n: int,
    want_logprobs: bool,
    token_text: TokenText,
) -> dict:
    choices = []
    for i, st in enumerate(states):
        choices.append(
            {
                "index": i,
                "message": chat_message(st),
                "logprobs": chat_logprobs(st.logprobs, token_text) if want_logprobs else None,
                "finish_reason": st.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": total_usage(states, n),
    }


def tool_call(c: dict, with_index: bool = False) -> dict:
    out = {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
    return dict(index=c["index"], **out) if with_index else out


def chat_message(st: ChoiceState) -> dict:
    # A thinking model's reasoning goes next to the answer (vLLM's reasoning_content).
    extra = {"reasoning_content": st.reasoning} if st.reasoning else {}
    if not st.tool_calls:
        return {"role": "assistant", "content": st.text, **extra}
    # OpenAI sends null content when a reply is only tool calls.
    return {
        "role": "assistant",
        "content": st.text if st.text.strip() else None,
        **extra,
        "tool_calls": [tool_call(c) for c in st.tool_calls],
    }


def completion_response(
    rid: str,
    model: str,
    created: int,
    states: list[ChoiceState],
    n: int,
    want_logprobs: bool,
    token_text: TokenText,
) -> dict:
    choices = []
    for i, st in enumerate(states):
        choices.append(
            {
                "index": i,
                "text": st.text,
                "logprobs": completion_logprobs(st.logprobs, token_text, 0) if want_logprobs else None,
                "finish_reason": st.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": total_usage(states, n),
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    delta: dict,
    finish_reason: Optional[str] = None,
    logprobs: Optional[dict] = None,
    with_usage: bool = False,
) -> dict:
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage:
        chunk["usage"] = None  # only the final usage chunk carries numbers
    return chunk


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: Optional[str] = None,
    logprobs: Optional[dict] = None,
    with_usage: bool = False,
) -> dict:
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, model: str, created: int, obj: str, usage_dict: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_dict}
