"""Batched sampling on the logits' device: one pass over the whole batch, one device->host copy per step.

Per row: the request's logit bias (added to the raw logits), penalties (repetition over prompt + output,
HF semantics; presence / frequency over the output, OpenAI semantics) from device-resident token state,
the grammar bitmask, then either the argmax (greedy) or temperature, top-k / top-p / min-p and a draw.
Draws are counter-based (sampling_rng.py): keyed by the request's stream and the position of the token, so
a seeded request's tokens do not depend on what else is in the batch, and unseeded requests differ from
each other without a shared generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sidecar.engine.request import Request, TokenLogprob
from sidecar.engine.sampling_rng import SALT_TOKEN, KeyedDraws, gumbel, row_keys
from sidecar.engine.sampling_tensors import (
    F_MIN_P,
    F_REP,
    F_TEMP,
    F_TOP_P,
    I_LROWS,
    I_POS,
    I_PROWS,
    I_SLOT,
    I_SROWS,
    I_STREAM,
    I_TOPK,
    SamplingTensors,
    StepParams,
)
from sidecar.engine.structured import apply_bitmask
from sidecar.model.kernels.cpu import argmax as argmax_kernel, keyed_uniform
from sidecar.model.kernels.cpu.argmax import argmax

_NEG_INF = float("-inf")


def filter_logits_batch(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    top_k_max: int,
    full_sort: bool,
    any_top_p: bool,
    any_min_p: bool,
) -> torch.Tensor:
    """Mask (to -inf) each row's tokens outside its top-k / nucleus top-p / min-p set, in that order.

    x: [B, V] logits already divided by the temperature. top_k: int64 [B] (0: off, and < V); top_p, min_p:
    float32 [B] (1 / 0: off). The host-side summary says what any row needs: ``top_k_max`` the largest
    top-k, ``full_sort`` some row has a nucleus but no top-k (so the nucleus may reach past top_k_max).
    One sort (or one top-k of width top_k_max) serves every row: thresholds are per-row values, and a token
    tied with a row's last kept token is kept too. Returns a new tensor."""
    if full_sort or top_k_max > 0:
        vals = x.sort(-1, descending=True).values if full_sort else x.topk(top_k_max, -1).values
        k = top_k.clamp(max=vals.shape[-1]).unsqueeze(-1)
        kth = vals.gather(-1, (k - 1).clamp(min=0))
        thr = kth.masked_fill(k == 0, _NEG_INF)
        if any_top_p:
            probs = vals.masked_fill(vals < thr, _NEG_INF).softmax(-1)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            keep = ((probs.cumsum(-1) - probs) < top_p.unsqueeze(-1)).sum(-1, keepdim=True).clamp(min=1)
            nucleus = vals.gather(-1, keep - 1).masked_fill(top_p.unsqueeze(-1) >= 1.0, _NEG_INF)
            thr = torch.maximum(thr, nucleus)
        x = x.masked_fill(x < thr, _NEG_INF)
    if any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True), _NEG_INF)
    return x


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / nucleus top-p / min-p: one row [V] or rows [N, V] sharing the
    settings. The same filter the sampler applies to its batch."""
    x = logits.unsqueeze(0) if logits.dim() == 1 else logits
    n, v = x.shape
    k = top_k if 0 < top_k < v else 0
    if k == 0 and top_p >= 1.0 and min_p <= 0.0:
        return logits
    dev = x.device
    out = filter_logits_batch(
        x,
        torch.full((n,), k, dtype=torch.int64, device=dev),
        torch.full((n,), top_p, dtype=torch.float32, device=dev),
        torch.full((n,), min_p, dtype=torch.float32, device=dev),
        k,
        top_p < 1.0 and k == 0,
        top_p < 1.0,
        min_p > 0.0,
    )
    return out[0] if logits.dim() == 1 else out


def apply_penalties(
    logits: torch.Tensor, step: StepParams, seen: torch.Tensor, subtract: torch.Tensor, num_rows: int
) -> None:
    """In place on the penalised rows of logits [B, V], from their slots' device state: repetition (HF: a
    seen token's logit is divided by the penalty when positive, multiplied when not), then presence and
    frequency (the slot's ``subtract`` row)."""
    everyone = len(step.penalised) == num_rows
    rows = None if everyone else step.ints[: len(step.penalised), I_PROWS]
    ints = step.ints if everyone else step.ints[rows]
    f = step.floats if everyone else step.floats[rows]
    x = logits if everyone else logits[rows]
    slots = ints[:, I_SLOT]
    if step.any_repetition:
        rep = f[:, F_REP : F_REP + 1]
        x = torch.where(seen[slots], torch.where(x > 0, x / rep, x * rep), x)
    if step.any_presence:
        x = x - subtract[slots]
    if everyone:
        logits.copy_(x)
    else:
        logits[rows] = x


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B] on the logits' device (for a runner feeding the next step)
    ids: list[int]  # the same ids on the host (the step's one device->host copy)
    logprobs: list[Optional[TokenLogprob]]


class PendingSample:
    """A step's sampled ids (and logprobs) on their way to the host. ``token_ids`` stays on the device, where
    the next step may read it at once; ``result()`` waits for the one device->host copy, started (to
    pinned memory, behind an event) when this object was made, and then reads it."""

    def __init__(
        self,
        tokens: torch.Tensor,
        flat: torch.Tensor,
        reqs: list[Request],
        step: Optional[StepParams],
        with_logprobs: bool,
    ) -> None:
        self.token_ids = tokens
        self.reqs, self._step, self._with_lp = reqs, step, with_logprobs
        self._event = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat
        self._out: Optional[SamplerOutput] = None

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def result(self) -> SamplerOutput:
        if self._out is None:
            if self._event is not None:
                self._event.synchronize()
            self._out = _parse(self.token_ids, self._host.tolist(), self._step, self.reqs, self._with_lp)
        return self._out


def _parse(
    tokens: torch.Tensor, flat: list, step: Optional[StepParams], reqs: list[Request], with_logprobs: bool
) -> SamplerOutput:
    """The host lists of ``Sampler._flatten``'s layout: ids, then (with logprobs) chosen and top-n values."""
    n = len(reqs)
    if not with_logprobs:
        return SamplerOutput(tokens, [int(t) for t in flat], [None] * n)
    ids = [int(t) for t in flat[:n]]
    lrows, top = step.logprobs, step.top_n_max
    m = len(lrows)
    lps: list[Optional[TokenLogprob]] = [None] * n
    for j, i in enumerate(lrows):
        k = reqs[i].params.logprobs
        base = n + m + j * top
        pairs = [(int(flat[base + m * top + t]), flat[base + t]) for t in range(k)]
        lps[i] = TokenLogprob(token_id=ids[i], logprob=flat[n + j], top=pairs)
    return SamplerOutput(tokens, ids, lps)


class Sampler:
    """One token per row of a batch. ``seed`` keys the unseeded requests' streams; ``max_num_seqs`` sizes the
    persistent parameter buffer and the penalty slots (a larger batch grows them)."""

    def __init__(self, device: torch.device, seed: int = 0, max_num_seqs: int = 256) -> None:
        self.device = device
        self.tensors = SamplingTensors(device, seed, max_num_seqs)
        if device.type == "cpu":
            keyed_uniform.available()  # its kernel built (or found cached) now, not at the first sampled step
            argmax_kernel.available()

    def draws_for(self, req: Request) -> KeyedDraws:
        """The request's keyed draws from its next token on (speculative verification)."""
        return KeyedDraws(self.tensors.state(req).stream, req.num_tokens)

    def release(self, req: Request) -> None:
        """The request ended (finished, failed or aborted): return what the sampler holds for it."""
        self.tensors.release(req)

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        masks: Optional[tuple[list[int], torch.Tensor]] = None,
        salt: int = SALT_TOKEN,
    ) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """``sample`` for callers that want host lists only: (ids, logprobs)."""
        out = self.sample(logits, reqs, masks, salt)
        return out.ids, out.logprobs

    # Inference mode: the runner's logits are inference tensors and penalties update them in place.
    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        masks: Optional[tuple[list[int], torch.Tensor]] = None,
        salt: int = SALT_TOKEN,
    ) -> SamplerOutput:
        """logits: [B, V] float32, row i for reqs[i]; penalised rows are updated in place. ``masks``: (rows,
        int32 bitmask [len(rows), ceil(V/32)]) of the structured-output requests; their disallowed tokens are
        never sampled. ``salt``: SALT_REDRAW for a second draw at the same positions (a grammar refused the
        first). Logprobs are of the unpenalised, unmasked distribution."""
        return self.sample_async(logits, reqs, masks, salt).result()

    @torch.inference_mode()
    def sample_async(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        masks: Optional[tuple[list[int], torch.Tensor]] = None,
        salt: int = SALT_TOKEN,
        ahead: int = 0,
    ) -> PendingSample:
        """``sample`` without waiting for the ids: the draws are queued on the device and their copy to the
        host started. ``ahead``: tokens every request sampled that the host has not appended yet (an
        overlapped step; see SamplingTensors.prepare)."""
        n, v = logits.shape
        step = self.tensors.prepare(reqs, v, ahead)
        raw_lp = None
        if step is not None and step.logprobs:
            raw = logits if len(step.logprobs) == n else logits[step.ints[: len(step.logprobs), I_LROWS]]
            raw_lp = raw.log_softmax(-1)
        if any(r.params.logit_bias for r in reqs):
            self._apply_bias(logits, reqs)
        if step is not None and step.penalised:
            apply_penalties(logits, step, self.tensors.seen, self.tensors.subtract, n)
        if masks is not None:
            apply_bitmask(logits, masks[0], masks[1])
        if step is None or not step.sampled:
            tokens = argmax(logits)
        else:
            tokens = self._draw(logits, step, salt)
        if step is not None:
            self.tensors.record(step, tokens, reqs)
        return self._to_host(tokens, raw_lp, step, reqs)

    def _apply_bias(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """In place: add each biased row's ``logit_bias`` to its logits (one scattered add for the batch).
        A request's bias reaches the device once and stays with its sampler state."""
        rows, ids, vals = [], [], []
        for i, r in enumerate(reqs):
            if not r.params.logit_bias:
                continue
            st = self.tensors.state(r)
            if st.bias is None:
                b = r.params.logit_bias
                st.bias = (
                    torch.tensor(list(b.keys()), dtype=torch.long, device=logits.device),
                    torch.tensor(list(b.values()), dtype=torch.float32, device=logits.device),
                )
            rows.append(torch.full_like(st.bias[0], i))
            ids.append(st.bias[0])
            vals.append(st.bias[1])
        logits.index_put_(
            (torch.cat(rows), torch.cat(ids)), torch.cat(vals).to(logits.dtype), accumulate=True
        )

    def _draw(self, logits: torch.Tensor, step: StepParams, salt: int) -> torch.Tensor:
        everyone = len(step.sampled) == logits.shape[0]
        rows = None if everyone else step.ints[: len(step.sampled), I_SROWS]
        ints = step.ints if everyone else step.ints[rows]
        f = step.floats if everyone else step.floats[rows]
        x = (logits if everyone else logits[rows]) / f[:, F_TEMP : F_TEMP + 1]
        x = filter_logits_batch(
            x,
            ints[:, I_TOPK],
            f[:, F_TOP_P],
            f[:, F_MIN_P],
            step.top_k_max,
            step.full_sort,
            step.any_top_p,
            step.any_min_p,
        )
        # Gumbel-max over the filtered logits: the exponential race argmax(p / E) in log space.
        drawn = argmax(x + gumbel(row_keys(ints[:, I_STREAM], ints[:, I_POS], salt), x.shape[-1]))
        if everyone:
            return drawn
        return argmax(logits).index_copy_(0, rows, drawn)

    @staticmethod
    def _to_host(
        tokens: torch.Tensor, raw_lp: Optional[torch.Tensor], step: Optional[StepParams], reqs: list[Request]
    ) -> PendingSample:
        """Ids (and logprobs) start to the host in one copy: with logprobs, ids, chosen and top-n values travel
        together as float64 (token ids are exact in float64)."""
        n = len(reqs)
        if raw_lp is None:
            return PendingSample(tokens, tokens, reqs, step, False)
        lrows = step.logprobs
        chosen = tokens if len(lrows) == n else tokens[step.ints[: len(lrows), I_LROWS]]
        parts = [tokens.double(), raw_lp.gather(-1, chosen.unsqueeze(-1)).double().flatten()]
        if step.top_n_max:
            vals, idx = raw_lp.topk(step.top_n_max, -1)
            parts += [vals.double().flatten(), idx.double().flatten()]
        return PendingSample(tokens, torch.cat(parts), reqs, step, True)
