"""OpenAI request bodies -> protocol-neutral ``GenerationRequest``s.

One HTTP call becomes ``len(prompts) * n`` engine requests. Choice ``k`` of a
call answers prompt ``k // n`` and, when the caller gave a seed, samples with
``seed + (k % n)``: the choices differ from one another, and the i-th choice of
a prompt is the same whether the prompt came alone or in a batch.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from sidecar.engine.structured import Constraint
from sidecar.server.openai.models import ChatCompletionRequest, CompletionRequest, _Sampling
from sidecar.server.service import GenerationRequest, ServiceError
from sidecar.server.structured_check import check_constraint
from sidecar.server.tools import ToolSpec
from sidecar.server.validation import invalid, sampling_params

# OpenAI's legacy /v1/completions default; chat runs to the end of the context by default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
FALLBACK_MAX_TOKENS = 64


def _seed(seed: Optional[int], i: int) -> Optional[int]:
    if seed is None:
        return None
    s = seed + i
    return s - 2**64 if s >= 2**64 else s  # stays in the signed/unsigned 64-bit range SamplingParams accepts


def _params(
    body: _Sampling, max_tokens: int, logprobs: Optional[int], choice: int, structured: Optional[Constraint]
) -> Any:
    kw: dict[str, Any] = {"max_tokens": max_tokens, "seed": _seed(body.seed, choice), "logprobs": logprobs}
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "stop_token_ids",
        "speculative",
        "kv_budget",
        "kv_eviction",
    ):
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if body.top_k is not None:
        kw["top_k"] = max(body.top_k, 0)  # vLLM spells "disabled" as -1, the engine as 0
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.logit_bias:
        kw["logit_bias"] = logit_bias(body.logit_bias)
    kw["structured"] = structured  # one object for every choice: checked, keyed and compiled once
    if body.use_beam_search:  # one engine request keeps best_of (or n) beams; the n best are the choices
        if structured is not None:
            field = getattr(structured, "origin", "") or "response_format"
            raise ServiceError("invalid_argument", f"{field}: cannot be used with use_beam_search")
        kw["beam_width"] = body.best_of or body.n or 1
        if body.length_penalty is not None:
            kw["length_penalty"] = body.length_penalty
    return sampling_params(**kw)


def logit_bias(raw: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) as the engine's {id: bias}; a key that is not a
    token id is a 400 naming the field (range and count are checked by SamplingParams)."""
    out: dict[int, float] = {}
    for k, v in raw.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 10:
            raise invalid("logit_bias", f"keys must be token ids (decimal strings), got {k!r}")
        out[int(k)] = v
    return out


def beam_requests(reqs: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """Beam search: one request per prompt (every n-th choice's), its n best hypotheses the n choices. The
    semantic cache keeps one answer, so a call asking several sequences skips it."""
    firsts = reqs[::n]
    if n > 1:
        for r in firsts:
            r.cache_control = "skip"
    return firsts


def output_constraint(body: _Sampling) -> Optional[Constraint]:
    """response_format / guided_* -> the engine's constraint; a schema the grammar cannot compile is
    a 400 naming the field."""
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        return check_constraint(Constraint("json_object"), "response_format")
    if rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        return check_constraint(
            Constraint("json", js.schema_ if js.schema_ is not None else {}, bool(js.strict)),
            "response_format.json_schema.schema",
        )
    if body.guided_json is not None:
        return check_constraint(Constraint("json", body.guided_json), "guided_json")
    if body.guided_regex is not None:
        return check_constraint(Constraint("regex", body.guided_regex), "guided_regex")
    if body.guided_choice is not None:
        return check_constraint(Constraint("choice", list(body.guided_choice)), "guided_choice")
    return None


def chat_tools(body: ChatCompletionRequest) -> dict[str, Any]:
    """tools / tool_choice / parallel_tool_calls -> GenerationRequest fields."""
    if body.tools is None and body.tool_choice is None:
        return {}
    tools = [
        ToolSpec(
            t.function.name,
            t.function.description or "",
            t.function.parameters
            if t.function.parameters is not None
            else {"type": "object", "properties": {}},
            bool(t.function.strict),
        )
        for t in body.tools or []
    ]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        choice = "function:" + choice.function.name
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }


def _common(body: _Sampling, request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "priority": body.priority or 0,
        "cache_control": body.cache_control or "default",
        "cache_salt": body.cache_salt or "",
        "cache_sampled": bool(body.cache_sampled),
        "model": body.model,
    }


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    # "developer" is OpenAI's newer name for the system role; names are not part of chat templates
    # (except a tool message's, which names the tool that answered).
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def chat_requests(
    body: ChatCompletionRequest, call_id: str, max_model_len: Optional[int]
) -> list[GenerationRequest]:
    n = body.n or 1
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len or FALLBACK_MAX_TOKENS
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = chat_messages(body)
    explicit = (body.max_completion_tokens or body.max_tokens) is not None
    tools = chat_tools(body)
    structured = output_constraint(body)
    return [
        GenerationRequest(
            messages=messages,
            params=_params(body, max_tokens, logprobs, i, structured),
            max_tokens_set=explicit,
            chat_template_kwargs=body.chat_template_kwargs,
            reasoning_effort=body.reasoning_effort,
            **tools,
            **_common(body, f"{call_id}-{i}"),
        )
        for i in range(n)
    ]


def completion_requests(body: CompletionRequest, call_id: str) -> list[GenerationRequest]:
    n = body.n or 1
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    out = []
    structured = output_constraint(body)
    for p, prompt in enumerate(body.prompts()):
        for i in range(n):
            k = p * n + i
            src: dict[str, Union[str, list[int]]] = (
                {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
            )
            out.append(
                GenerationRequest(
                    params=_params(body, max_tokens, body.logprobs, i, structured),
                    max_tokens_set=body.max_tokens is not None,
                    **src,
                    **_common(body, f"{call_id}-{k}"),
                )
            )
    return out
