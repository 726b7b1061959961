"""The device sampler's start-up check (``self_check.run``'s ``sampler_check``): the batched sampler on the
logits' device against the same sampler on CPU tensors, the reference.

One batch of reference logits is sampled under a spread of settings (greedy, temperature, top-k, top-p,
min-p, penalties, logprobs; every sampled row seeded, so both runs draw with the same keyed noise). Greedy
rows must pick the same token; the sampled rows' final probabilities (after penalties, temperature and
filters) must agree within ``PROB_TOLERANCE``, and then their draws must be the same token; logprobs
must agree within the same tolerance. Any difference, or an exception, is the reason the path stays off.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler, filter_logits

PROB_TOLERANCE = 1e-3
CASES = (
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(logprobs=3),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=5, seed=12),
    SamplingParams(temperature=0.7, top_p=0.9, seed=13),
    SamplingParams(temperature=1.2, min_p=0.05, seed=14),
    SamplingParams(
        temperature=0.9,
        top_k=20,
        top_p=0.95,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        seed=15,
        logprobs=2,
    ),
)


def device_sampler_check(device: torch.device, seed: int) -> Callable[[torch.Tensor], Optional[str]]:
    """The check for a sampler on ``device`` with engine seed ``seed``."""
    return lambda logits: compare(device, seed, logits)


def _requests(prompt: list[int], output: list[int]) -> list[Request]:
    reqs = []
    for i, p in enumerate(CASES):
        r = Request(f"sampler-check-{i}", prompt, p)
        for t in output:
            r.append_token(t)
        reqs.append(r)
    return reqs


def _probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return filter_logits(x.float() / max(p.temperature, 1e-5), p.top_k, p.top_p, p.min_p).softmax(-1)


@torch.inference_mode()
def compare(device: torch.device, seed: int, logits: torch.Tensor) -> Optional[str]:
    """None when the sampler on ``device`` agrees with the CPU reference on ``logits`` [R, V], else why not."""
    ref_logits = logits.detach().float().cpu()
    x = ref_logits[torch.arange(len(CASES)) % ref_logits.shape[0]].contiguous()
    order = x[0].argsort(descending=True).tolist()
    prompt, output = order[:3] + order[-2:], order[3:6]  # penalties touch likely and unlikely tokens
    got_x, ref_x = x.to(device), x.clone()
    got = Sampler(device, seed, len(CASES)).sample(got_x, _requests(prompt, output))
    ref = Sampler(torch.device("cpu"), seed, len(CASES)).sample(ref_x, _requests(prompt, output))
    for i, p in enumerate(CASES):
        if not p.greedy:  # the sampler penalised its rows in place: compare what the draw saw
            diff = float((_probs(got_x[i].cpu(), p) - _probs(ref_x[i], p)).abs().max())
            if not diff <= PROB_TOLERANCE:
                return f"sampling probabilities differ from the CPU reference by {diff:.3g} in row {i}"
        if got.ids[i] != ref.ids[i]:
            kind = "greedy token" if p.greedy else "seeded draw"
            return f"{kind} differs from the CPU reference in row {i}: {got.ids[i]} != {ref.ids[i]}"
        g, r = got.logprobs[i], ref.logprobs[i]
        if (g is None) != (r is None) or (
            g is not None
            and (
                abs(g.logprob - r.logprob) > PROB_TOLERANCE
                or len(g.top) != len(r.top)
                or any(abs(a - b) > PROB_TOLERANCE for (_, a), (_, b) in zip(g.top, r.top))
            )
        ):
            return f"logprobs differ from the CPU reference in row {i}"
    return None
