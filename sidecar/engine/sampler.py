"""Batched sampling with per-request settings.

Seeded requests draw from their own ``torch.Generator`` and consume exactly one
vocabulary-sized draw per token, so their output does not depend on what else
is in the batch. Unseeded requests share the engine's generator.
"""
from __future__ import annotations

from typing import Optional

import torch

from sidecar.engine.request import Request, TokenLogprob
from sidecar.engine.structured import apply_bitmask

_U64 = (1 << 64) - 1


def apply_penalties(logits: torch.Tensor, req: Request) -> None:
    """In place on one row. Repetition penalty (prompt + output, HF semantics);
    presence/frequency penalties (output only, OpenAI semantics)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits.index_select(0, seen)
        vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        logits.index_copy_(0, seen, vals)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / nucleus top-p / min-p, for one row [V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & _U64)

    def _generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        if req.generator is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed & _U64)
            req.generator = g
        return req.generator

    # Inference mode: the runner's logits are inference tensors and penalties update them in place.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 masks: Optional[tuple[list[int], torch.Tensor]] = None) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """logits: [B, V] float32, row i for reqs[i]. ``masks``: (rows, int32 bitmask [len(rows), ceil(V/32)])
        of the structured-output requests; their disallowed tokens are never sampled. Returns sampled ids
        and optional logprobs (of the unmasked distribution)."""
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_lp = logits.log_softmax(-1) if any(want_lp) else None
        for i, r in enumerate(reqs):
            if r.params.uses_penalties:
                apply_penalties(logits[i], r)
        if masks is not None:
            apply_bitmask(logits, masks[0], masks[1])
        tokens = logits.argmax(-1)
        sampled_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        for i in sampled_rows:
            p = reqs[i].params
            row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = row.softmax(-1)
            # Exponential race: argmax(p / E), E ~ Exp(1), is a draw from p using one generator call.
            q = torch.empty_like(probs).exponential_(generator=self._generator_for(reqs[i]))
            tokens[i] = (probs / q).argmax()
        ids = tokens.tolist()
        lps: list[Optional[TokenLogprob]] = []
        for i, r in enumerate(reqs):
            if not want_lp[i]:
                lps.append(None)
                continue
            row = raw_lp[i]
            n = r.params.logprobs
            top = []
            if n:
                vals, idx = torch.topk(row, n)
                top = list(zip(idx.tolist(), vals.tolist()))
            lps.append(TokenLogprob(token_id=ids[i], logprob=float(row[ids[i]]), top=top))
        return ids, lps
