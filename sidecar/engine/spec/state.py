"""Per-request speculation state: the adaptive proposal length of one request (held in
``Request.spec_state`` by spec/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MAX_COOLDOWN_STEPS = 32
DECAY = 0.8  # weight of older verifications in the acceptance estimate (recent text predicts best)
MIN_GAIN = 1.02  # speculate only when the expected tokens per unit of step cost beat plain decode by this


@dataclass
class SpecState:
    """Per-request adaptive proposal length.

    The request's per-token acceptance probability ``alpha`` is estimated from its recent verifications
    (a proposal stops at its first rejection, so a verification is ``accepted`` successes and, unless all
    were accepted, one failure; older ones decay). With ``costs[k]`` the step cost of verifying k proposed
    tokens relative to a plain decode step, k is the one that maximises expected emitted tokens
    ``1 + alpha + ... + alpha^k`` per unit of cost; when no k beats plain decode by MIN_GAIN, the request
    stops speculating for a number of steps
    that doubles with every failed probe (up to MAX_COOLDOWN_STEPS) and then probes again with k = 1, so
    text the n-gram table cannot predict costs at most an occasional extra verified token."""

    costs: list[float]  # costs[k]: relative step cost with k proposed tokens (costs[0] == 1)
    successes: float = 1.5  # prior: alpha = 0.6 before any verification
    failures: float = 1.0
    cooldown: int = 0
    misses: int = 0
    probing: bool = False

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def choose_k(self, costs: Optional[Sequence[float]] = None) -> int:
        """Proposal length for the next step (0: do not speculate), priced by ``costs`` (default: the
        request's own, those of a batch of one)."""
        costs = self.costs if costs is None else costs
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
