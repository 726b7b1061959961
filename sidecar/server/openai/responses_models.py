"""Request body of ``POST /v1/responses`` (OpenAI's Responses API), strict like the chat body.

``input`` items and ``tools`` are kept as plain JSON here and checked item by item in
``responses``, so an unsupported item or tool type is refused with its exact place
(``input[2].type``, ``tools[0].type``) rather than pydantic's union report. Fields OpenAI defines
that this server cannot honour are in ``models._UNSUPPORTED["ResponsesRequest"]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from sidecar.server.openai.models import _Strict

MAX_INPUT_ITEMS = 4096
MAX_METADATA_KEYS = 16
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ResponsesFormat(_Strict):
    """``text.format``: flat, unlike chat's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponsesFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError("invalid_value", "text.format: json_schema needs name and schema")
        return self


class ResponsesText(_Strict):
    format: Optional[ResponsesFormat] = None


class Reasoning(_Strict):
    effort: Optional[Effort] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: Optional[bool] = None  # accepted: events carry no obfuscation padding


class ResponsesRequest(_Strict):
    model: Optional[str] = Field(None, description="Served model or adapter name; omitted: the served model.")
    input: Union[str, Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]]
    instructions: Optional[str] = None
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[ResponsesText] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    metadata: Optional[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]] = (
        None
    )
    stream: Optional[bool] = None
    stream_options: Optional[ResponsesStreamOptions] = None
    store: Optional[bool] = None
    previous_response_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    reasoning: Optional[Reasoning] = None
    user: Optional[str] = Field(None, max_length=256)
    safety_identifier: Optional[str] = Field(None, max_length=256)
    # A routing hint on OpenAI's side; here every prompt's prefix is cached already.
    prompt_cache_key: Optional[str] = Field(None, max_length=256)

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise PydanticCustomError("invalid_value", "metadata: at most {n} keys", {"n": MAX_METADATA_KEYS})
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("invalid_value", "stream_options: only allowed when stream is true")
        return self
