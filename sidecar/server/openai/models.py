"""Request bodies of the OpenAI-compatible HTTP API (pydantic, strict).

Every model forbids unknown fields, so a typo is a 400 naming the field rather
than a silently ignored setting. Fields that OpenAI defines but this server
cannot honour (tools, logit_bias, echo, ...) are listed in ``_UNSUPPORTED``
with the values that mean "feature off": those values are accepted and dropped
(clients often send the defaults explicitly), any other value is refused with
an ``unsupported_field`` error naming the field. Strict mode refuses "1" for a
number and true for an integer, as OpenAI does.

Ranges mirror ``SamplingParams.validate`` so the published schema tells
clients the same limits the engine enforces.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from sidecar.engine.request import MAX_LOGPROBS, MAX_STOP_STRINGS

MAX_CHOICES = 16  # n per prompt; each choice is one engine request
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions call
MAX_EMBED_INPUTS = 256
# Engine requests one call may create (prompts x n): one call must not take the whole server.
MAX_SEQUENCES_PER_CALL = 64
MAX_TOKEN_ID = 2**31 - 1  # range check only; the engine checks against the vocabulary

_NONE = (None,)
_UNSUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "ChatCompletionRequest": {
        "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
        "function_call": (None, "none"), "parallel_tool_calls": _NONE,
        "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "audio": _NONE,
        "modalities": (None, ["text"]), "prediction": _NONE, "reasoning_effort": _NONE,
        "web_search_options": _NONE, "service_tier": (None, "auto", "default"), "store": (None, False),
        "metadata": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": _NONE,
    },
    "CompletionRequest": {
        "suffix": _NONE, "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}),
        "tools": (None, []), "response_format": (None, {"type": "text"}),
    },
    "ChatMessage": {
        "tool_calls": (None, []), "function_call": _NONE, "tool_call_id": _NONE, "audio": _NONE,
        "refusal": _NONE,
    },
    "EmbeddingRequest": {"dimensions": _NONE},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        table = _UNSUPPORTED.get(cls.__name__)
        if not table or not isinstance(data, dict):
            return data
        kept, refused = {}, []
        for key, value in data.items():
            if key in table:
                # Type-exact comparison: best_of=true must not pass as best_of=1.
                if not any(type(value) is type(ok) and value == ok for ok in table[key]):
                    refused.append(key)
                continue  # a "feature off" value: dropped
            kept[key] = value
        if refused:
            raise PydanticCustomError("unsupported_field", "{fields}: not supported by this server",
                                      {"field": refused[0], "fields": ", ".join(refused)})
        return kept


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Stop = Union[Annotated[str, Field(min_length=1)],
             Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)], None]
CacheControl = Literal["default", "skip", "refresh", "only"]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: Optional[str] = Field(None, description="Served model name; omitted means the served model.")
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    stop: Stop = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    user: Optional[str] = Field(None, max_length=256)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # Extensions accepted the way vLLM accepts them.
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=64)
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    priority: Optional[int] = Field(None, ge=-(2**31), lt=2**31)
    # Sidecar extensions: semantic cache control and prefix-cache isolation.
    cache_control: Optional[CacheControl] = None
    cache_sampled: Optional[bool] = None
    cache_salt: Optional[str] = Field(None, max_length=256)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Sampling":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_value", "stream_options: only allowed when stream is true")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)]]
    name: Optional[str] = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs: requires logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise PydanticCustomError("invalid_value",
                                      "max_completion_tokens: conflicts with max_tokens; send one of them")
        return self


Prompt = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
              Field(min_length=1, max_length=MAX_BATCH_PROMPTS)],
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _bound_sequences(self) -> "CompletionRequest":
        n, k = self.n or 1, len(self.prompts())
        if n * k > MAX_SEQUENCES_PER_CALL:
            raise PydanticCustomError("invalid_value", "n: {k} prompts x n={n} make {total} sequences, more than the "
                                      "limit of {limit} per request", {"k": k, "n": n, "total": n * k,
                                                                       "limit": MAX_SEQUENCES_PER_CALL})
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch: one entry per prompt, text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class EmbeddingRequest(_Strict):
    input: Union[Annotated[str, Field(min_length=1)],
                 Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]]
    model: Optional[str] = None
    encoding_format: Optional[Literal["float", "base64"]] = None
    user: Optional[str] = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _refuse_token_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            inp = data.get("input")
            if isinstance(inp, list) and inp and all(
                    isinstance(x, int) or (isinstance(x, list) and x and all(isinstance(t, int) for t in x))
                    for x in inp):
                raise PydanticCustomError(
                    "unsupported_field", "input: token-id input is not supported for embeddings; send text",
                    {"field": "input"})
        return data

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
