"""Speculative verification: decides how many proposed tokens the target accepts and
which token follows them, so that the output distribution equals the target's alone."""

from typing import List, Optional, Protocol, Tuple

import torch


class Draws(Protocol):
    """Independent random draws per proposal index i (the token at the request's position + i)."""

    def uniform(self, i: int) -> float: ...

    def categorical(self, probs: torch.Tensor, i: int) -> int: ...


def verify_greedy(proposed: List[int], target_argmax: List[int]) -> Tuple[int, int]:
    """target_argmax has len(proposed) + 1 entries (the target's choice after each prefix).
    Returns (accepted count, next token): the next token is the target's own choice at the
    first mismatch, or the bonus token after all accepted -- identical to plain greedy."""
    n = 0
    while n < len(proposed) and proposed[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampled(
    proposed: List[int], p: torch.Tensor, q: Optional[torch.Tensor], draws: Draws
) -> Tuple[int, int]:
    """p: [k+1, V] target probabilities; q: [k, V] proposal probabilities, or None for a
    deterministic proposer (q is a point mass, so acceptance is p(x) and the residual is p
    with x removed). Standard rejection sampling: accept x with min(1, p(x)/q(x)); on
    reject sample from norm(max(0, p - q)); after all accepted sample the bonus from p[k].
    ``draws`` (the sampler's keyed draws of the request) gives the uniform of the test at i and the
    draw of the token at i; they are independent of each other and of the proposal, which is what
    keeps the output distributed as the target."""
    for i, x in enumerate(proposed):
        px = p[i, x]
        qx = q[i, x] if q is not None else torch.ones((), dtype=p.dtype)
        u = draws.uniform(i)
        if u < min(1.0, (px / qx).item() if qx > 0 else 1.0):
            continue
        if q is not None:
            resid = torch.clamp(p[i] - q[i], min=0)
        else:
            resid = p[i].clone()
            resid[x] = 0
        if resid.sum() <= 0:  # p == q: rejection has probability 0; fall back to p for safety.
            resid = p[i]
        return i, draws.categorical(resid, i)
    return len(proposed), draws.categorical(p[len(proposed)], len(proposed))
