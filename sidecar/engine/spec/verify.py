"""Speculative verification: decides how many proposed tokens the target accepts and
which token follows them, so that the output distribution equals the target's alone."""
from typing import List, Optional, Tuple

import torch


def verify_greedy(proposed: List[int], target_argmax: List[int]) -> Tuple[int, int]:
    """target_argmax has len(proposed) + 1 entries (the target's choice after each prefix).
    Returns (accepted count, next token): the next token is the target's own choice at the
    first mismatch, or the bonus token after all accepted -- identical to plain greedy."""
    n = 0
    while n < len(proposed) and proposed[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampled(proposed: List[int], p: torch.Tensor, q: Optional[torch.Tensor],
                   gen: torch.Generator) -> Tuple[int, int]:
    """p: [k+1, V] target probabilities; q: [k, V] proposal probabilities, or None for a
    deterministic proposer (q is a point mass, so acceptance is p(x) and the residual is p
    with x removed). Standard rejection sampling: accept x with min(1, p(x)/q(x)); on
    reject sample from norm(max(0, p - q)); after all accepted sample the bonus from p[k]."""
    for i, x in enumerate(proposed):
        px = p[i, x]
        qx = q[i, x] if q is not None else torch.ones((), dtype=p.dtype)
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        if u < min(1.0, (px / qx).item() if qx > 0 else 1.0):
            continue
        if q is not None:
            resid = torch.clamp(p[i] - q[i], min=0)
        else:
            resid = p[i].clone()
            resid[x] = 0
        total = resid.sum()
        if total <= 0:  # p == q: rejection has probability 0; fall back to p for safety.
            resid = p[i]
            total = resid.sum()
        tok = int(torch.multinomial((resid / total).float(), 1, generator=gen).item())
        return i, tok
    tok = int(torch.multinomial(p[len(proposed)].float(), 1, generator=gen).item())
    return len(proposed), tok
