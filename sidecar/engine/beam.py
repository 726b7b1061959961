"""Beam search in the continuous batch: every live beam is a running ``Request``; a group's step picks the
best continuations over all its beams' log-softmax rows, forks beams that continue twice (the fork takes
the parent's KV blocks by reference, ``KVCacheManager.fork``) and drops beams that do not continue.

Selection follows Hugging Face transformers' beam search (``num_beams=W``, ``early_stopping=False``, one
prompt per batch) step for step, in float32 with the same tensor operations:
- candidates: the top ``K = max(2, 1 + #eos) * W`` of ``log_softmax(row) + beam score`` over all beams;
- a candidate "hits" when its token is an EOS token (not with ``ignore_eos``), its text reaches a stop
  string, or it reaches ``max_tokens`` (or the context);
- the next beams are the top W candidates that do not hit; a hitting candidate ranked among the first W
  becomes a finished hypothesis scored ``cum_logprob / generated_len ** length_penalty`` and joins the W
  best hypotheses if it beats one;
- the group ends when every candidate hits, or once all W hypothesis slots are full and the best running
  beam's score, normalised by the current length, cannot beat the worst hypothesis (HF's heuristic).

Invariants:
- A beam waits for its group with ``beam_row`` set and nothing left to compute (``num_tokens ==
  num_computed_tokens``), so the scheduler leaves it out of steps until the group step appends its token.
- Every live beam of a group has generated the same number of tokens; the group step runs only when every
  live beam holds a row. A preempted beam (the scheduler preempts a group whole) recomputes its row.
- A group's blocks are its live beams' block tables; every beam leaves the scheduler (and returns its
  references) when it is dropped, when the group finishes and when it is aborted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from sidecar.engine.beam_params import BeamSequence
from sidecar.engine.request import FinishReason, Request, RequestOutput, RequestStatus

_NEG = -1.0e9  # HF's "not selectable" score offset


class BeamGroup:
    """One prompt's beam search state (host side)."""

    def __init__(self, group_id: str, first: Request, eos_ids: tuple[int, ...]) -> None:
        p = first.params
        self.group_id = group_id
        self.first = first
        self.params = p
        self.width = p.beam_width
        self.eos = () if p.ignore_eos else tuple(eos_ids)
        self.k = max(2, 1 + len(self.eos)) * self.width
        self.beams: list[Request] = [first]  # live beams, best running score first
        self.scores = torch.zeros(1, dtype=torch.float32)  # their cumulative log-probabilities
        self.done_scores = torch.full((self.width,), _NEG, dtype=torch.float32)
        self.done_valid = torch.zeros(self.width, dtype=torch.bool)
        self.done: list[Optional[tuple[list[int], float, str]]] = [None] * self.width
        self.generated = 0
        self.unsatisfied = True  # HF: the best running beam may still beat the worst hypothesis
        self.num_forks = 0
        self.deadline = first.deadline
        self.first_token_time: Optional[float] = None

    def ready(self) -> bool:
        return all(b.beam_row is not None for b in self.beams)


class BeamSearch:
    """The engine's beam groups (owned by LLMEngine, called from its step)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.groups: dict[str, BeamGroup] = {}

    # -- admission ------------------------------------------------------------------------------------
    def add(self, req: Request, lora: Optional[str]) -> None:
        """Start a group whose first beam is ``req`` (its prompt). Raises ValueError naming the field that
        cannot work: a width the batch, the vocabulary or the KV cache cannot hold, or an adapter."""
        e, p = self.engine, req.params
        w = p.beam_width
        if lora is not None:
            raise ValueError("lora: beam search runs on the base model; leave the adapter out")
        if w > e.config.max_num_seqs:
            raise ValueError(f"beam_width: {w} beams exceed max_num_seqs={e.config.max_num_seqs}")
        group = BeamGroup(req.request_id, req, e.eos_token_ids)
        if group.k > e.vocab_size:
            raise ValueError(f"beam_width: {w} needs {group.k} candidates, the vocabulary has {e.vocab_size}")
        bs = e.config.block_size
        longest = min(req.num_prompt_tokens + p.max_tokens, e.max_model_len)
        if w * -(-longest // bs) > e.kv.num_blocks:  # a preempted group recomputes every beam unshared
            raise ValueError(
                f"beam_width: {w} beams of up to {longest} tokens need {w * -(-longest // bs)} KV blocks, "
                f"the cache has {e.kv.num_blocks}; lower beam_width or max_tokens"
            )
        req.request_id = f"{group.group_id}#beam0"
        req.params = dataclasses.replace(p, speculative=False)
        req.beam_group = group
        e.scheduler.add(req)  # may raise QueueFullError
        self.groups[group.group_id] = group

    # -- the step ---------------------------------------------------------------------------------------
    def split(
        self, reqs: list[Request], logits: torch.Tensor, num_spec: dict[str, int]
    ) -> tuple[list[Request], Optional[torch.Tensor]]:
        """Take the beams' rows out of a step's sampled rows (each beam keeps its row); returns the other
        requests and their rows (one, or 1 + proposed tokens, each), in order."""
        if not any(r.beam_group is not None for r in reqs):
            return reqs, logits
        keep_reqs, keep_rows, start = [], [], 0
        for r in reqs:
            n = 1 + num_spec.get(r.request_id, 0)
            if r.beam_group is not None:
                r.beam_row = logits[start]
            else:
                keep_reqs.append(r)
                keep_rows.extend(range(start, start + n))
            start += n
        if not keep_reqs:
            return [], None
        return keep_reqs, logits[torch.tensor(keep_rows, device=logits.device)]

    @torch.inference_mode()
    def advance(self, outputs: list[RequestOutput]) -> None:
        """Run the step of every group whose live beams all hold their row. Groups with as many live beams and
        candidates share one log-softmax over their rows and one top-k over each group's beams x vocabulary
        (HF's batched form: a row's values do not depend on the rows beside it)."""
        ready: dict[tuple[int, int], list[BeamGroup]] = {}
        for g in self.groups.values():
            if g.ready():
                ready.setdefault((len(g.beams), g.k), []).append(g)
        for (n, k), groups in ready.items():
            beams = [b for g in groups for b in g.beams]
            rows = torch.stack([b.beam_row for b in beams]).to(dtype=torch.float32, device="cpu")
            for b in beams:
                b.beam_row = None
            vocab = rows.shape[-1]
            scores = torch.stack([g.scores for g in groups])
            acc = (torch.log_softmax(rows, dim=-1).view(len(groups), n, vocab) + scores[:, :, None]).view(
                len(groups), n * vocab
            )
            tops, idxs = torch.topk(acc, k, dim=1)
            for g, top, idx in zip(groups, tops, idxs.tolist()):
                self._group_step(g, top, idx, vocab, outputs)

    def _group_step(
        self, g: BeamGroup, top: torch.Tensor, idx: list[int], vocab: int, outputs: list[RequestOutput]
    ) -> None:
        """One group's step from its top ``k`` candidates: scores ``top`` at flat indices ``idx`` (beam x
        vocabulary)."""
        e, p, w = self.engine, g.params, g.width
        parents = [i // vocab for i in idx]
        tokens = [i % vocab for i in idx]
        gen = g.generated + 1
        if g.first_token_time is None:
            g.first_token_time = time.monotonic()
        at_length = gen >= p.max_tokens or g.first.num_prompt_tokens + gen >= e.max_model_len
        reasons = [self._hit(g, g.beams[b], t, at_length) for b, t in zip(parents, tokens)]
        hits = torch.tensor([r is not None for r in reasons])
        running = top + hits.to(torch.float32) * _NEG
        nxt = torch.topk(running, w).indices.tolist()
        # Finished hypotheses: a hitting candidate among the first W, kept when it beats a held one.
        did = hits & (torch.arange(g.k) < w)
        norm = top / (gen**p.length_penalty)
        norm += (~did) * _NEG
        merged = torch.cat((g.done_scores, norm))
        keep = torch.topk(merged, w).indices.tolist()
        old = g.done
        g.done = [
            old[i]
            if i < w
            else self._hypothesis(g, parents[i - w], tokens[i - w], top[i - w], reasons[i - w])
            for i in keep
        ]
        g.done_valid = torch.cat((g.done_valid, did))[keep]
        g.done_scores = merged[keep]
        g.generated = gen
        new_scores = running[nxt]
        best = new_scores[:1] / (gen**p.length_penalty)
        worst = torch.where(g.done_valid, torch.min(g.done_scores), _NEG)
        g.unsatisfied = g.unsatisfied and bool(torch.any(best > worst))
        e.counters["generation_tokens"] += len(g.beams)
        if not g.unsatisfied or bool(hits.all()):
            self._finish(g, outputs)
            return
        self._reseat(g, [(parents[c], tokens[c]) for c in nxt])
        g.scores = new_scores

    def _hit(self, g: BeamGroup, beam: Request, token: int, at_length: bool) -> Optional[str]:
        """Why the candidate (``beam`` + ``token``) ends, or None."""
        if token in g.eos:
            return "stop"
        if g.params.stop and self._stop_at(g, beam.output_token_ids + [token]) is not None:
            return "stop"
        return "length" if at_length else None

    def _stop_at(self, g: BeamGroup, ids: list[int]) -> Optional[int]:
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        found = [text.find(s) for s in g.params.stop if s in text]
        return min(found) if found else None

    @staticmethod
    def _hypothesis(g: BeamGroup, parent: int, token: int, cum: torch.Tensor, reason: Optional[str]):
        if reason is None:
            return None  # an empty slot (HF keeps its score far below any real one)
        return (g.beams[parent].output_token_ids + [token], float(cum), reason)

    def _reseat(self, g: BeamGroup, picks: list[tuple[int, int]]) -> None:
        """The next beams: the first pick of a parent continues the parent's request; a further pick forks it
        (shared blocks); a parent without a pick leaves the scheduler. Forks copy the parent's state before
        any token is appended."""
        e = self.engine
        taken: set[int] = set()
        beams: list[Request] = []
        for parent, _ in picks:
            src = g.beams[parent]
            if parent not in taken:
                taken.add(parent)
                beams.append(src)
            else:
                beams.append(self._fork(g, src))
        for i, b in enumerate(g.beams):
            if i not in taken:
                b.beam_group, b.status = None, RequestStatus.FINISHED
                e.scheduler.remove(b)
        for b, (_, token) in zip(beams, picks):
            b.append_token(token)
        g.beams = beams

    def _fork(self, g: BeamGroup, src: Request) -> Request:
        g.num_forks += 1
        child = Request(
            f"{g.group_id}#beam{g.num_forks}",
            src.prompt_token_ids,
            src.params,
            priority=src.priority,
            cache_salt=src.cache_salt,
            arrival_time=src.arrival_time,
            tenant=src.tenant,
        )
        child.output_token_ids = list(src.output_token_ids)
        child.all_token_ids = list(src.all_token_ids)
        child.block_hashes = list(src.block_hashes)
        child.num_computed_tokens = src.num_computed_tokens
        child.kv_policy, child.kv_evicted = src.kv_policy, src.kv_evicted
        child.num_cached_tokens = src.num_cached_tokens
        child.first_scheduled_time = src.first_scheduled_time
        child.status = RequestStatus.RUNNING
        child.beam_group = g
        self.engine.kv.fork(src, child)
        self.engine.scheduler.running.append(child)
        return child

    # -- the end ----------------------------------------------------------------------------------------
    def _release(self, g: BeamGroup) -> None:
        for b in g.beams:
            b.beam_group, b.beam_row, b.status = None, None, RequestStatus.FINISHED
            self.engine.scheduler.remove(b)
        g.beams = []
        self.groups.pop(g.group_id, None)
        self.engine.counters["num_requests_finished"] += 1

    def _finish(self, g: BeamGroup, outputs: list[RequestOutput]) -> None:
        self._release(g)
        seqs = []
        for entry, score, valid in zip(g.done, g.done_scores.tolist(), g.done_valid.tolist()):
            if valid and entry is not None:
                ids, cum, reason = entry
                text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
                cut = self._stop_at(g, ids) if g.params.stop else None
                seqs.append(BeamSequence(ids, text if cut is None else text[:cut], cum, score, reason))
        outputs.append(self._output(g, seqs, seqs[0].finish_reason if seqs else "length", None))

    def abort(self, group_id: str, reason: str, outputs: list[RequestOutput]) -> bool:
        """End the group now (its blocks returned); False when no group has this id."""
        g = self.groups.get(group_id)
        if g is None:
            return False
        self._release(g)
        outputs.append(self._output(g, [], FinishReason.ABORT.value, reason))
        return True

    def expired(self, now: float) -> list[str]:
        return [gid for gid, g in self.groups.items() if g.deadline is not None and g.deadline <= now]

    def _output(self, g: BeamGroup, seqs: list[BeamSequence], reason: str, abort: Optional[str]):
        f = g.first
        best = seqs[0] if seqs else BeamSequence([], "", 0.0, 0.0, reason)
        now = time.monotonic()
        return RequestOutput(
            request_id=g.group_id,
            prompt=f.prompt,
            prompt_token_ids=f.prompt_token_ids,
            token_ids=list(best.token_ids),
            text=best.text,
            new_token_ids=list(best.token_ids),
            delta_text=best.text,
            finished=True,
            finish_reason=reason,
            abort_reason=abort,
            num_cached_tokens=max(f.num_cached_tokens, 0),
            queue_s=(f.first_scheduled_time - f.arrival_time) if f.first_scheduled_time else None,
            ttft_s=(g.first_token_time - f.arrival_time) if g.first_token_time else None,
            e2e_s=now - f.arrival_time,
            beams=seqs,
        )
