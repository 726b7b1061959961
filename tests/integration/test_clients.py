"""The clients people point at an OpenAI-compatible server, against a real ``sidecar serve`` on the default
model (SmolLM2-135M-Instruct): LangChain's ChatOpenAI, LiteLLM and the openai client's ``parse``.

Each call is what a new user would write first; the assertions are on what they get back (text, parsed
objects, tool calls), never on timings.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from sidecar.config import DEFAULT_MODEL


class Verdict(BaseModel):
    """Whether the statement is true."""

    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=10)


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher(
        "--model", DEFAULT_MODEL, "--kv-cache-memory-gb", "0.5", "--max-num-seqs", "8"
    ) as sc:
        yield sc


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server.http_base}/v1",
        api_key="unused",
        model=DEFAULT_MODEL,
        temperature=0,
        max_retries=0,
        timeout=600,
    )


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}  # as clients send it: no additionalProperties


def test_langchain_invoke_and_stream_agree(chat_model):
    short = chat_model.bind(max_tokens=12)
    whole = short.invoke("Name a colour.")
    assert isinstance(whole.content, str) and whole.content.strip()
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in short.stream("Name a colour."))
    assert streamed == whole.content  # greedy: the same tokens, whatever the transport


def test_langchain_structured_output(chat_model):
    verdict = chat_model.with_structured_output(Verdict).invoke("Is Paris in France? Answer yes or no.")
    assert isinstance(verdict, Verdict)
    assert verdict.answer in ("yes", "no") and 0 <= verdict.confidence <= 10


@pytest.mark.parametrize(
    "question", ["What is the weather in Paris?", "Weather in Tokyo please", "Is it raining in London?"]
)
def test_langchain_bind_tools_required_returns_one_call_and_ends_without_max_tokens(chat_model, question):
    msg = chat_model.bind_tools([get_weather], tool_choice="required").invoke(question)
    assert msg.response_metadata["finish_reason"] == "tool_calls", msg
    # "required" is one or more calls, then the end of the turn: never the same call again.
    assert msg.tool_calls, msg
    assert len({json.dumps([c["name"], c["args"]], sort_keys=True) for c in msg.tool_calls}) == len(
        msg.tool_calls
    )
    for call in msg.tool_calls:
        assert call["name"] == "get_weather"
        assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    assert not msg.content


def test_litellm_completion_with_tools(server):
    import litellm

    resp = litellm.completion(
        model=f"openai/{DEFAULT_MODEL}",
        api_base=f"{server.http_base}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)


def test_openai_parse_returns_the_pydantic_model(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.parse(
        model=DEFAULT_MODEL,
        temperature=0,
        response_format=Verdict,
        messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.answer in ("yes", "no")


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=600)


def test_openai_parallel_tool_calls_false_gives_exactly_one_call(server):
    for question in ("What is the weather in Rome?", "Weather in Oslo and in Lima?"):
        r = _client(server).chat.completions.create(
            model=DEFAULT_MODEL,
            temperature=0,
            messages=[{"role": "user", "content": question}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}


class Lookup(BaseModel):
    """Look up a word in the dictionary."""

    word: str
    language: Literal["en", "fr", "de"] = "en"


def test_openai_pydantic_model_tool_ends_with_a_valid_call(server):
    tool = {
        "type": "function",
        "function": {
            "name": "Lookup",
            "description": Lookup.__doc__,
            "parameters": Lookup.model_json_schema(),
        },
    }  # no additionalProperties
    r = _client(server).chat.completions.create(
        model=DEFAULT_MODEL,
        temperature=0,
        messages=[{"role": "user", "content": "What does 'ephemeral' mean?"}],
        tools=[tool],
        tool_choice="required",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    args = [c.function.arguments for c in choice.message.tool_calls]
    assert args and len(set(args)) == len(args)
    for a in args:
        assert isinstance(Lookup.model_validate_json(a), Lookup)
        assert set(json.loads(a)) <= {"word", "language"}
