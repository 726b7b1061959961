"""Request-level types: SamplingParams, Request, RequestOutput, FinishReason."""

from __future__ import annotations

import dataclasses

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from sidecar.engine.structured import Constraint, to_constraint

if TYPE_CHECKING:  # collaborators that keep per-request state on a Request (none imports this module)
    import torch

    from sidecar.engine.detokenizer import IncrementalDetokenizer
    from sidecar.engine.kv_evict import EvictionPolicy
    from sidecar.engine.sampling_tensors import RequestSampling
    from sidecar.engine.spec.state import SpecState

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request: each is a scattered add on the logits every step
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound; +-100 forces or bans a token outright
MAX_BEAM_WIDTH = 64
# Sampling options that mean nothing to beam search, with their off value: a beam request setting one is
# refused naming it (beam search ranks by exact log-probabilities, one grammar-free step per beam).
BEAM_REFUSED = (
    ("temperature", 0.0),
    ("top_p", 1.0),
    ("top_k", 0),
    ("min_p", 0.0),
    ("repetition_penalty", 1.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("seed", None),
    ("logprobs", None),
    ("structured", None),
    ("logit_bias", None),
    ("kv_budget", None),
    ("kv_eviction", None),
    ("prompt_logprobs", None),
)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; retry later."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated once, at construction (ValueError naming the field), and
    immutable after: ``dataclasses.replace`` makes a changed, again validated, copy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n alternatives per generated token; None = off
    skip_special_tokens: bool = True
    # Structured output: a JSON schema (dict), a regex (str), a choice list (list of str) or a
    # Constraint; always a Constraint (or None) once constructed.
    structured: Union[Constraint, dict, str, list, None] = None
    # Per-request opt-out of speculative decoding (when the engine has it on). Output is the same
    # either way under greedy, and equally distributed under sampling.
    speculative: bool = True
    # Token id -> additive bias in [-100, 100], applied to the raw logits before penalties, masks,
    # temperature and top-k / top-p (greedy too). Stored as a dict of int -> float once constructed.
    logit_bias: Optional[dict] = None
    # Beam search (engine/beam.py): None for sampling; an int >= 1 keeps that many beams, ranked by
    # cum_logprob / generated_len ** length_penalty. Options that mean sampling are refused with it.
    beam_width: Optional[int] = None
    length_penalty: float = 1.0
    # Bounded KV (engine/kv_evict.py): at most kv_budget tokens of KV kept, evicted by kv_eviction ("h2o" |
    # "streaming"); None: the engine's setting. prompt_logprobs=0: each prompt token's log-probability.
    kv_budget: Optional[int] = None
    kv_eviction: Optional[str] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        # Normalize the accepted shorthands (the only writes a SamplingParams ever gets), then validate.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        self._check()
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias) or None)
        object.__setattr__(self, "structured", to_constraint(self.structured))

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the first field that is invalid for a model with ``vocab_size`` tokens.
        Construction already checked everything else; this only reads."""
        for t in self.stop_token_ids:
            if vocab_size is not None and t >= vocab_size:
                raise ValueError(f"stop_token_ids: must be token ids in [0, vocab size), got {t!r}")
        for t in self.logit_bias or ():
            if vocab_size is not None and t >= vocab_size:
                raise ValueError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")

    def _check(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, msg: str) -> None:
            raise ValueError(f"{name}: {msg}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0):
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not (
            0.0 < self.repetition_penalty <= 10.0
        ):
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (-2.0 <= v <= 2.0):
                bad(name, f"must be in [-2, 2], got {v!r}")
        if self.seed is not None and (not is_int(self.seed) or not (-(2**63) <= self.seed < 2**64)):
            bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                bad("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                bad("stop_token_ids", f"must be token ids in [0, vocab size), got {t!r}")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.speculative, bool):
            bad("speculative", f"must be true or false, got {self.speculative!r}")
        if not isinstance(self.length_penalty, (int, float)) or not (-10.0 <= self.length_penalty <= 10.0):
            bad("length_penalty", f"must be a number in [-10, 10], got {self.length_penalty!r}")
        if self.kv_budget is not None and (not is_int(self.kv_budget) or self.kv_budget < 1):
            bad("kv_budget", f"must be a positive number of tokens, got {self.kv_budget!r}")
        if self.kv_eviction is not None and self.kv_eviction not in ("h2o", "streaming"):
            bad("kv_eviction", f"must be one of h2o, streaming, got {self.kv_eviction!r}")
        if self.prompt_logprobs not in (None, 0) or isinstance(self.prompt_logprobs, bool):
            bad("prompt_logprobs", f"must be 0 or None, got {self.prompt_logprobs!r}")
        if self.beam_width is not None:
            if not is_int(self.beam_width) or not (1 <= self.beam_width <= MAX_BEAM_WIDTH):
                bad("beam_width", f"must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
            for name, off in BEAM_REFUSED:
                if getattr(self, name) != off:
                    bad(name, f"cannot be used with beam search (beam_width), got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_logit_bias(bias: Any) -> dict:
    """``logit_bias`` as {token id: float bias}; raises ValueError naming ``logit_bias``."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias: must map token ids to biases, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"logit_bias: keys must be token ids >= 0, got {k!r}")
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE
        ):
            raise ValueError(f"logit_bias: bias of token {k} must be in [-100, 100], got {v!r}")
        out[k] = float(v)
    return out


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """A snapshot of one request, emitted by ``LLMEngine.step`` when it changes.

    ``token_ids``/``text`` are cumulative; ``new_token_ids``/``delta_text`` are
    what changed since the previous output of this request.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    abort_reason: Optional[str] = None  # "client" | "deadline" | "shutdown" | "error: ..."
    num_cached_tokens: int = 0
    queue_s: Optional[float] = None
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    logprobs: Optional[list[TokenLogprob]] = None
    new_logprobs: Optional[list[TokenLogprob]] = None
    # Beam search: every returned hypothesis (engine/beam_params.BeamSequence), best first; token_ids and
    # text above are the best one's. None for sampled requests.
    beams: Optional[list[Any]] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None  # when finished: None, then each prompt token's

    def merged_after(self, older: "RequestOutput") -> "RequestOutput":
        """This output as if it also carried the changes of ``older`` (the previous, unread output of the
        same request): deltas are concatenated, cumulative fields are this one's."""
        lps = (
            None
            if older.new_logprobs is None and self.new_logprobs is None
            else (older.new_logprobs or []) + (self.new_logprobs or [])
        )
        return dataclasses.replace(
            self,
            new_token_ids=older.new_token_ids + self.new_token_ids,
            delta_text=older.delta_text + self.delta_text,
            new_logprobs=lps,
        )


_ids = itertools.count()


class BeamGroupRef(Protocol):
    """What a beam's request knows of its group (engine/beam.py's BeamGroup): the scheduler preempts a
    group's ``beams`` together."""

    group_id: str
    beams: list["Request"]


def random_request_id() -> str:
    return f"req-{next(_ids)}-{time.monotonic_ns() % 10**9:09d}"


class Request:
    """Mutable engine-side state of one request. Owned by the engine thread."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        deadline: Optional[float] = None,
        arrival_time: Optional[float] = None,
        eos_token_ids: tuple[int, ...] = (),
        tenant: str = "",
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora = None  # the adapter's registration (LoraManager) or None: the base model
        self.lora_slot: Optional[int] = None  # the resident slot it pins while unfinished
        self.deadline = deadline  # time.monotonic() value, or None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.abort_reason: Optional[str] = None
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None
        self.logprobs: Optional[list[TokenLogprob]] = [] if params.logprobs is not None else None
        self.prompt_logprobs: Optional[list[float]] = [] if params.prompt_logprobs is not None else None
        # Filled by collaborators: block hashes (kv_cache), detokenizer (engine), the sampler's state (its
        # random stream and penalty slot: engine/sampling_tensors.py).
        self.block_hashes: list[bytes] = []
        self.detok: Optional[IncrementalDetokenizer] = None
        self.sampling: Optional[RequestSampling] = None
        # Speculative decoding: tokens proposed for this step (never part of all_token_ids, so never
        # hashed into the prefix cache) and the proposer's per-request state (engine/spec).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Optional[list[torch.Tensor]] = (
            None  # a draft's q row per proposed token (sampling)
        )
        self.spec_state: Optional[SpecState] = None
        # Beam search: the group this request is a live beam of (engine/beam.py), and its last logits row
        # while it waits for the group's other beams.
        self.beam_group: Optional[BeamGroupRef] = None
        self.beam_row: Optional[torch.Tensor] = None
        # Bounded KV (engine/kv_evict.py): the policy this sequence runs under (None: it keeps every block)
        # and how many of its computed tokens' KV it has evicted (whole blocks).
        self.kv_policy: Optional[EvictionPolicy] = None
        self.kv_evicted = 0
        self.text = ""
        self._emitted_tokens = 0
        self._emitted_text = 0
        self._emitted_logprobs = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def make_output(self) -> RequestOutput:
        """Snapshot with deltas since the previous snapshot."""
        new_ids = self.output_token_ids[self._emitted_tokens :]
        delta = self.text[self._emitted_text :]
        new_lp = None
        if self.logprobs is not None:
            new_lp = self.logprobs[self._emitted_logprobs :]
            self._emitted_logprobs = len(self.logprobs)
        self._emitted_tokens = len(self.output_token_ids)
        self._emitted_text = len(self.text)
        now = time.monotonic()
        finished = self.is_finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            text=self.text,
            new_token_ids=list(new_ids),
            delta_text=delta,
            finished=finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            abort_reason=self.abort_reason,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            queue_s=(self.first_scheduled_time - self.arrival_time) if self.first_scheduled_time else None,
            ttft_s=(self.first_token_time - self.arrival_time) if self.first_token_time else None,
            e2e_s=((self.finished_time or now) - self.arrival_time) if finished else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            new_logprobs=new_lp,
            prompt_logprobs=[None, *self.prompt_logprobs]
            if finished and self.prompt_logprobs is not None
            else None,
        )
