"""Beam search's public types: ``BeamSearchParams`` in, ``BeamSearchOutput`` (``.sequences`` best first) out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sidecar.engine.request import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """``LLM.beam_search``'s settings, validated at construction (ValueError naming the field).

    ``beam_width`` beams are kept per prompt; a hypothesis ends at an EOS token (unless ``ignore_eos``), at a
    ``stop`` string (its text cut before it) or at ``max_tokens``; hypotheses rank by
    ``cum_logprob / generated_len ** length_penalty`` as Hugging Face transformers' beam search does with
    its default ``early_stopping=False``."""

    beam_width: int = 4
    max_tokens: int = 64
    ignore_eos: bool = False
    length_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be true or false, got {self.ignore_eos!r}")
        self.sampling_params()  # the checks SamplingParams makes, naming these fields

    def sampling_params(self) -> SamplingParams:
        """The engine request these settings make (beam search through ``SamplingParams.beam_width``)."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
        )


@dataclass
class BeamSequence:
    """One finished hypothesis: its generated ``token_ids`` (an EOS that ended it included), ``text``,
    ``cum_logprob`` (sum of its tokens' log-probabilities) and ``score`` (the length-normalised
    ``cum_logprob / len(token_ids) ** length_penalty`` it was ranked by)."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


@dataclass
class BeamSearchOutput:
    """A prompt's beam search result: ``sequences`` best first (at most ``beam_width``)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    finish_reason: Optional[str] = None  # "abort" when it did not finish; otherwise the best sequence's
