"""Schemathesis against the real sidecar: generated valid and invalid bodies never get a 5xx.

The unit-level run (tests/unit/server/test_openai_schema.py) covers every route over a
fake service; this one sends the generation routes to the real engine, where
sampling settings, token ids and prompts reach the model. Generated lengths are
clamped (max_tokens <= 4, at most 2 choices and 2 prompts) so the run stays short
on CPU; everything else is as generated.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode


@pytest.fixture(scope="module")
def base_url(sidecar_launcher):
    with sidecar_launcher() as sc:
        yield sc.http_base


def _clamp(body: object) -> None:
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4  # the chat default runs to the end of the context
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:2]
    # A message without content is refused on a rule the schema cannot express (content is required unless an
    # assistant message carries tool calls); give such messages text so more generated bodies reach the engine.
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("content") is None and not message.get("tool_calls"):
            message["content"] = "hi"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generation_routes_never_answer_5xx(base_url, path, mode):
    operation = schemathesis.openapi.from_url(f"{base_url}/openapi.json")[path]["POST"]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    # Schema-valid chat bodies are mostly refused on semantics the schema cannot express (a tool message
    # needs content, the last message must be from the user or a tool, ...): 40 positive examples leave
    # a few that reach the engine.
    @settings(
        max_examples=15 if mode == GenerationMode.NEGATIVE else 40,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case):
        _clamp(case.body)
        response = case.call(base_url=base_url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()
    # Both kinds of data were really exercised: valid bodies are answered, invalid ones refused.
    assert (200 in statuses) if mode == GenerationMode.POSITIVE else (400 in statuses), statuses
