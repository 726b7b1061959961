"""Prompt log-probabilities (``SamplingParams(prompt_logprobs=0)``): the log-probability of each prompt token
given the tokens before it, from the hidden rows of the steps that compute the prompt.

``Request.prompt_logprobs[p]`` is the log-probability of prompt token ``p + 1``; rows are taken in position
order, once each (a preempted request recomputing its prompt adds nothing twice). Such a request takes no
prefix-cache hit (every prompt row is needed) and its prompt rows always run through the eager step.
"""

from __future__ import annotations

from typing import Any

import torch

from sidecar.engine.request import Request

ROWS_PER_PASS = 256  # logits rows materialised at once (rows x vocabulary float32)


def wants_rows(req: Request) -> bool:
    """Whether ``req``'s next computed rows include prompt positions it still needs."""
    return req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens - 1


def collect(model: Any, hidden: torch.Tensor, spans: list[tuple[Request, int, int, int]]) -> None:
    """Append to each request's ``prompt_logprobs`` from ``hidden`` rows: ``spans`` holds (request, first row,
    first position, rows) of each prompt chunk computed this step."""
    for req, row0, c, n in spans:
        done = req.prompt_logprobs
        lo, hi = max(c, len(done)), min(c + n, req.num_prompt_tokens - 1)
        for a in range(lo, hi, ROWS_PER_PASS):
            b = min(hi, a + ROWS_PER_PASS)
            logits = model.compute_logits(hidden[row0 + a - c : row0 + b - c]).float()
            nxt = torch.tensor(req.prompt_token_ids[a + 1 : b + 1], device=logits.device)
            lp = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]
            done.extend(lp.tolist())
