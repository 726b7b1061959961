"""gRPC SamplingParams -> engine SamplingParams: optional fields keep the engine's defaults when unset."""

import pytest

from sidecar.server.grpc import servicer
from sidecar.server.validation import ServiceError
from sidecar.v1 import sidecar_pb2 as pb


def test_unset_fields_keep_engine_defaults():
    p = servicer._params(pb.SamplingParams())
    assert (p.max_tokens, p.temperature, p.seed, p.speculative) == (64, 0.0, None, True)


def test_speculative_opt_out_and_other_fields_reach_the_engine():
    p = servicer._params(
        pb.SamplingParams(
            max_tokens=7, temperature=0.5, top_k=3, seed=11, speculative=False, stop=["x"], logprobs=2
        )
    )
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.speculative) == (7, 0.5, 3, 11, False)
    assert (p.stop, p.logprobs) == (["x"], 2)
    assert servicer._params(pb.SamplingParams(speculative=True)).speculative is True


def test_bad_value_names_the_sampling_field():
    with pytest.raises(ServiceError, match="sampling.top_p"):
        servicer._params(pb.SamplingParams(top_p=2.0))


def test_logit_bias_reaches_the_engine_and_bad_biases_name_the_field():
    p = servicer._params(pb.SamplingParams(logit_bias={5: 2.5, 9: -100.0}))
    assert p.logit_bias == {5: 2.5, 9: -100.0}
    with pytest.raises(
        ServiceError, match=r"^sampling\.logit_bias: bias of token 5 must be in \[-100, 100\]"
    ):
        servicer._params(pb.SamplingParams(logit_bias={5: 101.0}))


def test_chat_template_kwargs_and_reasoning_effort_reach_the_request():
    msg = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        chat_template_kwargs='{"enable_thinking": false}',
        reasoning_effort="low",
    )
    req = servicer._request(msg, None, chat=True)
    assert (req.chat_template_kwargs, req.reasoning_effort) == ({"enable_thinking": False}, "low")
    plain = servicer._request(pb.ChatRequest(messages=msg.messages), None, chat=True)
    assert (plain.chat_template_kwargs, plain.reasoning_effort) == (None, None)
    with pytest.raises(ServiceError, match="^chat_template_kwargs: must be JSON text"):
        servicer._request(pb.ChatRequest(messages=msg.messages, chat_template_kwargs="{"), None, chat=True)


def test_beam_width_and_length_penalty_reach_the_engine():
    p = servicer._params(pb.SamplingParams(max_tokens=5, beam_width=4, length_penalty=0.6))
    assert (p.beam_width, p.length_penalty, p.max_tokens) == (4, 0.6, 5)
    assert servicer._params(pb.SamplingParams()).beam_width is None


def test_beam_width_with_sampling_names_the_sampling_field():
    with pytest.raises(ServiceError, match="sampling.temperature"):
        servicer._params(pb.SamplingParams(beam_width=2, temperature=0.7))
    with pytest.raises(ServiceError, match="sampling.beam_width"):
        servicer._params(pb.SamplingParams(beam_width=65))
