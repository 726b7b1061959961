"""The sampler's per-step parameter tensors and per-request penalty state, kept on the sampling device.

Parameters: every request's row (stream, position, top-k, penalty slot, and as float32 pairs temperature,
top-p, min-p and the three penalties) is written into one persistent int64 host buffer, pinned on CUDA,
and reaches the device in a single copy per step; the float columns are a float32 view of the same rows.
Two such host buffers are used in turn, and one is rewritten only after an event says its last copy has
run, so a pinned asynchronous copy never reads a half-written row, even while an overlapped step's copy
still waits behind its forward.

Penalty state: a request with penalties holds a slot, a row of ``seen`` (bool [slots, V]: prompt and output
tokens, for the repetition penalty), of ``counts`` (int32 [slots, V]: output tokens) and of ``subtract``
(float32 [slots, V]: frequency * count + presence * (count > 0), what presence and frequency take off each
logit, kept so a step reads one tensor instead of recomputing it over the vocabulary). A slot is built
from the request's token lists once, then updated on the device with each sampled token. ``counted``
records how many output tokens the slot covers; when the request's output differs in length (a grammar
re-draw replaced a token) the slot is rebuilt, so the state can never drift from the tokens the request
really has. Slots are a cache: the least recently used one of a request
outside the current batch is taken over when none is free (its owner rebuilds on return), and
``release`` gives a finished request's slot back at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sidecar.engine.sampling_rng import stream_for

# int64 columns of a parameter row; the float32 view holds the rest from column 2 * _F0 on. I_*ROWS are
# not per-row fields: their first entries list the sampled, penalised and logprob rows (device indices).
I_STREAM, I_POS, I_TOPK, I_SLOT, I_SROWS, I_PROWS, I_LROWS = range(7)
_F0 = 7
F_TEMP, F_TOP_P, F_MIN_P, F_REP, F_PRES, F_FREQ = range(2 * _F0, 2 * _F0 + 6)
_WIDTH = _F0 + 3  # int64 columns in all
_MIN_SLOTS = 8


@dataclass
class RequestSampling:
    """The sampler's state of one request (``Request.sampling``)."""

    stream: int
    top_k: int
    floats: tuple[float, float, float, float, float, float]
    sampled: bool
    penalised: bool
    slot: Optional[int] = None
    counted: int = 0  # output tokens the slot's counts cover
    bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # logit_bias as device (ids, values)


@dataclass
class StepParams:
    """One step's batch as the sampler sees it. Row lists are host-side; tensors live on the device."""

    ints: torch.Tensor  # int64 [B, _WIDTH]
    floats: torch.Tensor  # float32 [B, 2 * _WIDTH]
    sampled: list[int]  # rows drawn at random (the others take the argmax)
    penalised: list[int]  # rows with repetition / presence / frequency penalties
    logprobs: list[int]  # rows that asked for logprobs
    top_n_max: int  # most top logprobs any row asked for
    top_k_max: int  # largest effective top-k among sampled rows (0: none)
    full_sort: bool  # some sampled row needs a nucleus without a top-k
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool  # some penalised row has a repetition penalty
    any_presence: bool  # some penalised row has a presence or frequency penalty


class SamplingTensors:
    def __init__(self, device: torch.device, seed: int, max_num_seqs: int) -> None:
        self.device = device
        self.seed = seed
        self.num_streams = 0
        self._alloc_rows(max(max_num_seqs, 1))
        self.seen: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.subtract: Optional[torch.Tensor] = None
        self.max_slots = max(max_num_seqs, 1)
        self.owners: list[Any] = []  # request holding each slot, or None
        self.last_use: list[int] = []
        self.clock = 0
        self.num_rebuilds = 0  # slots built from token lists (once per request, unless evicted or stale)

    def _alloc_rows(self, n: int) -> None:
        pin = self.device.type == "cuda"
        # Two host buffers used in turn, each with the event of its last copy: with overlapped steps the
        # next step's rows are written while the previous step's copy may still wait behind its forward.
        self._hosts = [torch.zeros((n, _WIDTH), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._copied: list[Any] = [None, None]
        self._turn = 0
        self.host = self._hosts[0]
        self.dev = (
            self.host
            if self.device.type == "cpu"
            else torch.zeros((n, _WIDTH), dtype=torch.int64, device=self.device)
        )

    def _next_host(self) -> None:
        """Switch to the other host buffer once the copy that last read it is done (two steps ago)."""
        if self.device.type == "cpu":
            return
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        self.host = self._hosts[self._turn]

    def state(self, req: Any) -> RequestSampling:
        st = req.sampling
        if st is None:
            p = req.params
            stream = stream_for(p.seed, self.seed, self.num_streams)
            self.num_streams += 1
            st = req.sampling = RequestSampling(
                stream=stream,
                top_k=p.top_k,
                floats=(
                    max(p.temperature, 1e-5),
                    p.top_p,
                    p.min_p,
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                ),
                sampled=not p.greedy,
                penalised=p.uses_penalties,
            )
        return st

    def prepare(self, reqs: list, vocab: int, ahead: int = 0) -> Optional[StepParams]:
        """Rows of this step on the device, or None when every row is a plain argmax without logprobs
        (nothing to copy). ``ahead``: tokens each request has sampled whose ids the host has not appended
        yet (an overlapped step): positions and penalty counts include them."""
        states = [self.state(r) for r in reqs]
        sampled = [i for i, s in enumerate(states) if s.sampled]
        penalised = [i for i, s in enumerate(states) if s.penalised]
        lps = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not sampled and not penalised and not lps:
            return None
        n = len(reqs)
        if n > self.host.shape[0]:
            self._alloc_rows(max(n, 2 * self.host.shape[0]))
        if penalised:
            self._take_slots([reqs[i] for i in penalised], vocab, ahead)
        self._next_host()
        ks = [s.top_k if s.sampled and 0 < s.top_k < vocab else 0 for s in states]
        lists = [sampled, penalised, lps]
        self.host[:n, :_F0] = torch.tensor(
            [
                (
                    s.stream,
                    r.num_tokens + ahead,
                    k,
                    -1 if s.slot is None else s.slot,
                    *(rows[i] if i < len(rows) else 0 for rows in lists),
                )
                for i, (s, r, k) in enumerate(zip(states, reqs, ks))
            ],
            dtype=torch.int64,
        )
        self.host.view(torch.float32)[:n, 2 * _F0 : 2 * _F0 + 6] = torch.tensor([s.floats for s in states])
        dev = self.dev[:n]
        if dev.data_ptr() != self.host.data_ptr():
            dev.copy_(self.host[:n], non_blocking=True)  # the one host->device copy of the step
            self._copied[self._turn] = torch.cuda.Event() if self.device.type == "cuda" else None
            if self._copied[self._turn] is not None:
                self._copied[self._turn].record()
        top_p = [states[i].floats[1] < 1.0 for i in sampled]
        return StepParams(
            ints=dev,
            floats=dev.view(torch.float32),
            sampled=sampled,
            penalised=penalised,
            logprobs=lps,
            top_n_max=max((reqs[i].params.logprobs for i in lps), default=0),
            top_k_max=max((ks[i] for i in sampled), default=0),
            full_sort=any(tp and ks[i] == 0 for tp, i in zip(top_p, sampled)),
            any_top_p=any(top_p),
            any_min_p=any(states[i].floats[2] > 0.0 for i in sampled),
            any_repetition=any(states[i].floats[3] != 1.0 for i in penalised),
            any_presence=any(states[i].floats[4] != 0.0 or states[i].floats[5] != 0.0 for i in penalised),
        )

    # -- penalty slots -------------------------------------------------------------------------------
    def _take_slots(self, reqs: list, vocab: int, ahead: int = 0) -> None:
        self.clock += 1
        batch = {id(r) for r in reqs}
        for r in reqs:
            st = r.sampling
            if st.slot is None or self.owners[st.slot] is not r:
                st.slot = self._free_slot(batch, vocab)
                self.owners[st.slot] = r
                st.counted = -1
            if st.counted != len(r.output_token_ids) + ahead:
                if ahead:  # a rebuild reads the host's token lists, which lack the tokens still in flight
                    raise RuntimeError(
                        f"penalty state of {r.request_id!r} is stale during an overlapped step"
                    )
                self._rebuild(st.slot, r)
                st.counted = len(r.output_token_ids)
            self.last_use[st.slot] = self.clock

    def _free_slot(self, batch: set, vocab: int) -> int:
        if None in self.owners:
            return self.owners.index(None)
        n = len(self.owners)
        if n < self.max_slots:  # grow geometrically up to max_num_seqs rows
            self._grow(vocab, min(max(_MIN_SLOTS, 2 * n), self.max_slots))
            return n
        if all(id(o) in batch for o in self.owners):  # a batch above max_num_seqs (direct callers only)
            self._grow(vocab, n + 1)
            return n
        victim = min(
            (i for i, o in enumerate(self.owners) if id(o) not in batch), key=self.last_use.__getitem__
        )
        self.owners[victim].sampling.slot = None  # its owner rebuilds from its token lists on return
        return victim

    def _grow(self, vocab: int, n: int) -> None:
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=self.device)
        counts = torch.zeros((n, vocab), dtype=torch.int32, device=self.device)
        subtract = torch.zeros((n, vocab), dtype=torch.float32, device=self.device)
        if self.seen is not None:
            m = self.seen.shape[0]
            seen[:m], counts[:m], subtract[:m] = self.seen, self.counts, self.subtract
        self.seen, self.counts, self.subtract = seen, counts, subtract
        self.owners += [None] * (n - len(self.owners))
        self.last_use += [0] * (n - len(self.last_use))

    def _rebuild(self, slot: int, req: Any) -> None:
        self.num_rebuilds += 1
        self.seen[slot].zero_()
        self.seen[slot, torch.tensor(req.all_token_ids, dtype=torch.long, device=self.device)] = True
        self.counts[slot].zero_()
        self.subtract[slot].zero_()
        if req.output_token_ids:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=self.device)
            self.counts[slot] = torch.bincount(out, minlength=self.counts.shape[1]).to(torch.int32)
            _, _, _, _, presence, frequency = req.sampling.floats
            c = self.counts[slot].float()
            self.subtract[slot] = torch.tensor(frequency) * c + torch.tensor(presence) * (c > 0).float()

    def record(self, step: StepParams, tokens: torch.Tensor, reqs: list) -> None:
        """Count the sampled tokens of the penalised rows, on the device (no host round trip)."""
        if not step.penalised:
            return
        rows = step.ints[: len(step.penalised), I_PROWS] if len(step.penalised) < len(reqs) else None
        slots = step.ints[:, I_SLOT] if rows is None else step.ints[rows, I_SLOT]
        toks = tokens if rows is None else tokens[rows]
        self.seen.index_put_((slots, toks), torch.ones((), dtype=torch.bool, device=self.device))
        self.counts.index_put_(
            (slots, toks), torch.ones((), dtype=torch.int32, device=self.device), accumulate=True
        )
        if step.any_presence:  # the same float32 expression as a rebuild, for the entries that changed
            f = step.floats if rows is None else step.floats[rows]
            c = self.counts[slots, toks].float()
            self.subtract[slots, toks] = f[:, F_FREQ] * c + f[:, F_PRES] * (c > 0).float()
        for i in step.penalised:
            reqs[i].sampling.counted += 1

    def release(self, req: Any) -> None:
        """The request ended: its slot (if it still holds one) is free for others."""
        st = req.sampling
        if st is not None and st.slot is not None and self.owners[st.slot] is req:
            self.owners[st.slot] = None
        if st is not None:
            st.slot = None

    def slots_in_use(self) -> int:
        return sum(o is not None for o in self.owners)
