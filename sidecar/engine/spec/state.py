"""Per-request speculation state: the adaptive proposal length of one request (held in
``Request.spec_state`` by spec/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

MAX_COOLDOWN_STEPS = 32
DECAY = 0.8  # weight of older verifications in the acceptance estimate (recent text predicts best)
MIN_GAIN = 1.02  # speculate only when the expected tokens per unit of step cost beat plain decode by this
# An n-gram proposal whose context matched at least this many tokens is "strong": in text that copies its input
# it is nearly always right, while one- and two-token matches in free text mostly are not. Each kind has its own
# acceptance estimate and back-off, so failed weak guesses never hold back a copy that has started.
STRONG_MATCH = 3


@dataclass
class Estimate:
    """Acceptance estimate and back-off of one kind of proposal.

    The per-token acceptance probability ``alpha`` is estimated from recent verifications (a proposal stops at
    its first rejection, so a verification is ``accepted`` successes and, unless all were accepted, one
    failure; older ones decay). When no k beats plain decode by MIN_GAIN, this kind stops speculating for a
    number of its opportunities that doubles with every failed probe (up to MAX_COOLDOWN_STEPS) and then probes
    again with k = 1."""

    successes: float = 1.5  # prior: alpha = 0.6 before any verification
    failures: float = 1.0
    cooldown: int = 0
    misses: int = 0
    probing: bool = False

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def choose_k(self, costs: Sequence[float]) -> int:
        if self.cooldown > 0:
            self.cooldown -= 1
            if self.cooldown == 0:
                self.probing = True
                return 1
            return 0
        if self.probing:
            return 1
        a, best_k, best, expected = self.alpha, 0, MIN_GAIN, 1.0
        for k in range(1, len(costs)):
            expected += a**k
            gain = expected / costs[k]
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self.misses += 1
            self.cooldown = min(1 << self.misses, MAX_COOLDOWN_STEPS)
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        self.successes = DECAY * self.successes + accepted
        self.failures = DECAY * self.failures + (1 if accepted < proposed else 0)
        if self.probing:
            self.probing = False
            if accepted == 0:  # failed probe: back off again, longer
                self.misses += 1
                self.cooldown = min(1 << self.misses, MAX_COOLDOWN_STEPS)
            else:
                self.misses = 0


@dataclass
class SpecState:
    """Per-request adaptive proposal length.

    With ``costs[k]`` the step cost of verifying k proposed tokens relative to a plain decode step, k is the
    one that maximises expected emitted tokens ``1 + alpha + ... + alpha^k`` per unit of cost, ``alpha`` the
    estimate of the kind of proposal at hand (``Estimate``): a draft model's proposals, or an n-gram lookup's
    weak (short match) or strong (at least STRONG_MATCH tokens matched) ones. Text the n-gram table cannot
    predict costs at most an occasional extra verified token; a copy that starts after many failed guesses is
    speculated on from its first strong match."""

    costs: list[float]  # costs[k]: relative step cost with k proposed tokens (costs[0] == 1)
    weak: Estimate = field(default_factory=Estimate)
    # Prior alpha = 0.75: a long exact match mostly continues (copies, renames, loops).
    strong: Estimate = field(default_factory=lambda: Estimate(successes=3.0, failures=1.0))
    last: Optional[Estimate] = None  # the estimate the pending proposal was chosen by

    @property
    def alpha(self) -> float:
        return self.weak.alpha

    @property
    def cooldown(self) -> int:
        return self.weak.cooldown

    def choose_k(self, costs: Optional[Sequence[float]] = None, match_len: Optional[int] = None) -> int:
        """Proposal length for the next step (0: do not speculate), priced by ``costs`` (default: the
        request's own, those of a batch of one), for a proposal whose context matched ``match_len`` tokens
        (None: a proposal of unknown strength, judged by the weak estimate)."""
        est = self.strong if match_len is not None and match_len >= STRONG_MATCH else self.weak
        self.last = est
        return est.choose_k(self.costs if costs is None else costs)

    def update(self, proposed: int, accepted: int) -> None:
        """The last proposal chosen by ``choose_k`` was verified: ``accepted`` of its ``proposed`` tokens."""
        (self.last or self.weak).update(proposed, accepted)
