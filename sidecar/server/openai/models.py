"""Request bodies of the OpenAI-compatible HTTP API (pydantic, strict).

Every model forbids unknown fields, so a typo is a 400 naming the field rather
than a silently ignored setting. Fields that OpenAI defines but this server
cannot honour (echo, legacy functions, ...) are listed in ``_UNSUPPORTED``
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
        "functions": (None, []),
        "function_call": (None, "none"),
        "audio": _NONE,
        "modalities": (None, ["text"]),
        "prediction": _NONE,
        "web_search_options": _NONE,
        "service_tier": (None, "auto", "default"),
        "store": (None, False),
        "metadata": (None, {}),
        "best_of": (None, 1),
        "echo": (None, False),
        "suffix": _NONE,
    },
    "CompletionRequest": {
        "suffix": _NONE,
        "echo": (None, False),
        "best_of": (None, 1),
        "tools": (None, []),
    },
    "ChatMessage": {"function_call": _NONE, "audio": _NONE, "refusal": _NONE},
    "EmbeddingRequest": {"dimensions": _NONE},
    "ResponsesRequest": {
        "include": (None, []),
        "truncation": (None, "disabled"),
        "service_tier": (None, "auto", "default"),
        "background": (None, False),
        "top_logprobs": (None, 0),
        "max_tool_calls": _NONE,
        "prompt": _NONE,
        "conversation": _NONE,
    },
    "ResponsesText": {"verbosity": (None, "medium")},
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
        beams = data.get("use_beam_search") is True  # best_of then counts the beams (vLLM's meaning)
        for key, value in data.items():
            if key in table and not (beams and key == "best_of"):
                # Type-exact comparison: best_of=true must not pass as best_of=1.
                if not any(type(value) is type(ok) and value == ok for ok in table[key]):
                    refused.append(key)
                continue  # a "feature off" value: dropped
            kept[key] = value
        if refused:
            raise PydanticCustomError(
                "unsupported_field",
                "{fields}: not supported by this server",
                {"field": refused[0], "fields": ", ".join(refused)},
            )
        return kept


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Stop = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)],
    None,
]
CacheControl = Literal["default", "skip", "refresh", "only"]


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "invalid_value", "response_format.json_schema: required exactly when type is json_schema"
            )
        return self


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
    # Token id (as a decimal string, OpenAI's shape) -> bias in [-100, 100]; checked in translate.
    logit_bias: Optional[dict[str, Union[float, int]]] = None
    # Extensions accepted the way vLLM accepts them.
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=64)
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    priority: Optional[int] = Field(None, ge=-(2**31), lt=2**31)
    speculative: Optional[bool] = Field(
        None,
        description="false: opt out of the sidecar's speculative decoding "
        "(same output); unset: the sidecar's setting",
    )
    # Bounded KV per sequence (the engine's kv_budget / kv_eviction for this request); checked by SamplingParams
    # and the engine (a budget below the sinks, a recent block and one more is refused).
    kv_budget: Optional[int] = Field(None, ge=1, description="most tokens of KV this sequence keeps")
    kv_eviction: Optional[str] = Field(None, description="h2o or streaming: which blocks go over the budget")
    # Beam search as vLLM accepts it: use_beam_search with best_of (or n) beams, the n best returned.
    use_beam_search: Optional[bool] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    length_penalty: Optional[float] = Field(None, ge=-10.0, le=10.0)
    # Sidecar extensions: semantic cache control and prefix-cache isolation.
    cache_control: Optional[CacheControl] = None
    cache_sampled: Optional[bool] = None
    cache_salt: Optional[str] = Field(None, max_length=256)
    # Structured output: OpenAI's response_format, and vLLM's guided_* extensions for regex and choice.
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[dict[str, Any]] = None
    guided_regex: Optional[Annotated[str, Field(min_length=1)]] = None
    guided_choice: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = None

    @model_validator(mode="after")
    def _one_format(self) -> "_Sampling":
        given = [n for n in ("guided_json", "guided_regex", "guided_choice") if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise PydanticCustomError(
                "invalid_value",
                "{field}: conflicts with {other}; send one output format",
                {"field": given[1], "other": given[0]},
            )
        return self

    @model_validator(mode="after")
    def _beam_search_fields(self) -> "_Sampling":
        if not self.use_beam_search:
            if self.length_penalty is not None:
                raise PydanticCustomError(
                    "invalid_value", "{field}: only with use_beam_search", {"field": "length_penalty"}
                )
        elif self.best_of is not None and (self.n or 1) > self.best_of:
            raise PydanticCustomError(
                "invalid_value",
                "n: {n} sequences asked of best_of={b} beams",
                {"field": "n", "n": self.n, "b": self.best_of},
            )
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Sampling":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_value", "stream_options: only allowed when stream is true")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str


class ToolCall(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    # Published so generated clients and fuzzers know: content may be left out only with tool_calls.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"anyOf": [{"required": ["content"]}, {"required": ["tool_calls"]}]},
    )
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, Annotated[list[TextPart], Field(min_length=1)], None] = None
    name: Optional[str] = Field(None, max_length=256)
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=128)]] = None
    tool_call_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[Annotated[list[ToolDef], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # Thinking models: extra chat-template variables (vLLM's extension, e.g. {"enable_thinking": false})
    # and OpenAI's effort levels ("none"/"minimal": thinking off; "low"/"medium"/"high": on).
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None

    @model_validator(mode="after")
    def _check_messages_and_tools(self) -> "ChatCompletionRequest":
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise PydanticCustomError(
                    "invalid_value",
                    "messages[{i}].content: required unless an assistant message carries tool_calls",
                    {"i": i},
                )
            if m.role == "tool" and m.tool_call_id is None:
                raise PydanticCustomError(
                    "invalid_value", "messages[{i}].tool_call_id: required for a tool message", {"i": i}
                )
        names = [t.function.name for t in self.tools or []]
        if (
            not isinstance(self.tool_choice, (str, type(None)))
            and self.tool_choice.function.name not in names
        ):
            raise PydanticCustomError(
                "invalid_value",
                "tool_choice: names the function '{name}', which is not in tools",
                {"name": self.tool_choice.function.name},
            )
        if self.tool_choice == "required" and not names:
            raise PydanticCustomError("invalid_value", "tool_choice: 'required' needs at least one tool")
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs: requires logprobs to be true")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise PydanticCustomError(
                "invalid_value", "max_completion_tokens: conflicts with max_tokens; send one of them"
            )
        return self


Prompt = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)
    ],
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _bound_sequences(self) -> "CompletionRequest":
        n, k = self.n or 1, len(self.prompts())
        if n * k > MAX_SEQUENCES_PER_CALL:
            raise PydanticCustomError(
                "invalid_value",
                "n: {k} prompts x n={n} make {total} sequences, more than the limit of {limit} per request",
                {"k": k, "n": n, "total": n * k, "limit": MAX_SEQUENCES_PER_CALL},
            )
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
    input: Union[
        Annotated[str, Field(min_length=1)],
        Annotated[
            list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBED_INPUTS)
        ],
    ]
    model: Optional[str] = None
    encoding_format: Optional[Literal["float", "base64"]] = None
    user: Optional[str] = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _refuse_token_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            inp = data.get("input")
            if (
                isinstance(inp, list)
                and inp
                and all(
                    isinstance(x, int) or (isinstance(x, list) and x and all(isinstance(t, int) for t in x))
                    for x in inp
                )
            ):
                raise PydanticCustomError(
                    "unsupported_field",
                    "input: token-id input is not supported for embeddings; send text",
                    {"field": "input"},
                )
        return data

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class LoadLoraAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (as vLLM has it): serve the PEFT adapter at ``lora_path`` as ``lora_name``;
    with ``tenant``, to that tenant's keys alone."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    tenant: Optional[str] = Field(None, min_length=1, max_length=128)


class UnloadLoraAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter: stop serving ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=128)
