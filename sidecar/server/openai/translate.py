"""OpenAI request bodies -> protocol-neutral ``GenerationRequest``s.

One HTTP call becomes ``len(prompts) * n`` engine requests. Choice ``k`` of a
call answers prompt ``k // n`` and, when the caller gave a seed, samples with
``seed + (k % n)``: the choices differ from one another, and the i-th choice of
a prompt is the same whether the prompt came alone or in a batch.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from sidecar.server.openai.models import ChatCompletionRequest, CompletionRequest, _Sampling
from sidecar.server.service import GenerationRequest
from sidecar.server.validation import sampling_params

# OpenAI's legacy /v1/completions default; chat runs to the end of the context by default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
FALLBACK_MAX_TOKENS = 64


def _seed(seed: Optional[int], i: int) -> Optional[int]:
    if seed is None:
        return None
    s = seed + i
    return s - 2**64 if s >= 2**64 else s  # stays in the signed/unsigned 64-bit range SamplingParams accepts


def _params(body: _Sampling, max_tokens: int, logprobs: Optional[int], choice: int) -> Any:
    kw: dict[str, Any] = {"max_tokens": max_tokens, "seed": _seed(body.seed, choice), "logprobs": logprobs}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "ignore_eos", "skip_special_tokens", "stop_token_ids"):
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if body.top_k is not None:
        kw["top_k"] = max(body.top_k, 0)  # vLLM spells "disabled" as -1, the engine as 0
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    return sampling_params(**kw)


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
    # "developer" is OpenAI's newer name for the system role; names are not part of chat templates.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


def chat_requests(body: ChatCompletionRequest, call_id: str, max_model_len: Optional[int]) -> list[GenerationRequest]:
    n = body.n or 1
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len or FALLBACK_MAX_TOKENS
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = chat_messages(body)
    explicit = (body.max_completion_tokens or body.max_tokens) is not None
    return [GenerationRequest(messages=messages, params=_params(body, max_tokens, logprobs, i),
                              max_tokens_set=explicit, **_common(body, f"{call_id}-{i}")) for i in range(n)]


def completion_requests(body: CompletionRequest, call_id: str) -> list[GenerationRequest]:
    n = body.n or 1
    max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    out = []
    for p, prompt in enumerate(body.prompts()):
        for i in range(n):
            k = p * n + i
            src: dict[str, Union[str, list[int]]] = (
                {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)})
            out.append(GenerationRequest(params=_params(body, max_tokens, body.logprobs, i),
                                         max_tokens_set=body.max_tokens is not None,
                                         **src, **_common(body, f"{call_id}-{k}")))
    return out
