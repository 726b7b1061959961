"""Speculative decoding in the engine step: propose before scheduling, verify after the forward.

Flow of one step for a request in decode:
1. ``propose`` puts up to k tokens in ``request.spec_token_ids``: n-gram prompt lookup (spec/ngram.py) or
   a draft model decoding them (spec/draft.py; for sampled requests also its distributions q).
2. The scheduler budgets them with the request's last real token (``ScheduledRequest.num_spec_tokens``)
   and the runner computes all k+1 positions in one forward as k+1 rows of the batched paged decode
   attention, each with its own context length, returning k+1 logit rows.
3. ``sample`` verifies the proposal against those rows: greedy keeps the longest prefix equal to the
   target's argmax plus the target's next token (exactly plain greedy); sampling uses rejection
   sampling, which leaves the output distributed as the target alone (see verify.py).
4. Rollback: ``num_computed_tokens`` advances over the last real token and the accepted proposals only,
   so the rejected positions' KV is never attended (attention reads up to the computed length) and is
   overwritten later; blocks that held only rejected positions go back to the pool now. Proposed tokens
   never enter ``all_token_ids`` before acceptance, so prefix-cache hashes never cover them.

Which requests speculate: those that opted in (``SamplingParams.speculative``), without a grammar
(structured output needs the grammar advanced per token; speculation is off for such requests), without
repetition/presence/frequency penalties (their distribution changes with every accepted token), and not
seeded sampling: a seeded request's output must not depend on the rest of the batch, but whether and how
far it speculates does (batch-size switch), and a verified token comes from an acceptance test or a
residual draw instead of the plain draw: the same law from the same keyed draws, not the same token.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from typing import Any, Optional, Sequence

import torch

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.linear_state import STATEFUL_REASON
from sidecar.engine.request import Request, TokenLogprob
from sidecar.engine.sampler import filter_logits
from sidecar.engine.runner import ModelRunner
from sidecar.engine.spec.draft import DraftProposer
from sidecar.engine.spec.ngram import NgramProposer
from sidecar.engine.spec.state import SpecState
from sidecar.model.kernels.cpu.argmax import argmax
from sidecar.model.loader import LoadedModel
from sidecar.engine.spec.verify import verify_greedy, verify_sampled

log = logging.getLogger("sidecar.engine")


class SpecDecoder:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        runner: Optional[ModelRunner] = None,
        target: Optional[LoadedModel] = None,
    ) -> None:
        self.enabled = config.speculative is not None
        if self.enabled and target is not None and target.args.linear_layers:
            # a rejected proposal would have to roll the linear layers' state back
            log.warning("speculative decoding off: %s", STATEFUL_REASON)
            self.enabled = False
        self.proposer: Any = NgramProposer()
        if self.enabled and config.speculative.startswith("draft:"):
            assert runner is not None and target is not None, "a draft-model proposer needs the target"
            self.proposer = DraftProposer(config, target, max_model_len, runner.num_blocks)
        self.max_k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        # Relative price of proposing and verifying k tokens: measured on this device at start (verifying
        # k + 1 rows, plus k draft steps for a draft model), unless the config fixes a linear price per token.
        # batch_costs[b] prices k for a request in a batch of b running requests, as if all of them
        # proposed k: a step of b (k + 1) rows against one of b rows (batch_costs[1] == costs). Extra
        # rows are nearly free while a step streams the weights once, and cost full price once it is
        # compute-bound, which on a CPU starts at a few rows.
        timed, grid = None, self._timing_grid()
        if self.enabled and config.speculative_token_cost is None and runner is not None:
            timed = runner.time_decode_rows(grid)
        if timed:
            d = self.proposer.step_cost(timed[0]) if isinstance(self.proposer, DraftProposer) else 0.0

            def t(r: int) -> float:  # linear between measured row counts
                i = bisect.bisect_left(grid, r)
                if grid[i] == r:
                    return timed[i]
                lo, hi = grid[i - 1], grid[i]
                return timed[i - 1] + (timed[i] - timed[i - 1]) * (r - lo) / (hi - lo)

            # Verifying more tokens never costs less than verifying fewer: noise in the timing must not
            # make a longer proposal look cheaper.
            self.batch_costs = [[]] + [
                list(
                    itertools.accumulate(
                        (max(1.0, t(b * (k + 1)) / t(b)) + k * d for k in range(self.max_k + 1)), max
                    )
                )
                for b in range(1, max(self.max_batch, 2))
            ]
        else:
            c = 0.15 if config.speculative_token_cost is None else config.speculative_token_cost
            self.batch_costs = [[]] + [[1.0 + c * k for k in range(self.max_k + 1)]] * max(
                self.max_batch - 1, 1
            )
        self.costs = self.batch_costs[1]
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0
        self.num_proposer_failures = 0
        self.num_emitted = 0  # tokens emitted by verification steps (accepted + the target's own)
        # acceptance_hist[a]: verifications that accepted exactly a proposed tokens.
        self.acceptance_hist = [0] * (self.max_k + 1)

    def _timing_grid(self) -> list[int]:
        """Row counts to time: 1..k+1 (one request) and a geometric grid up to the largest batch that
        speculates, each row verifying the longest proposal."""
        top = max(self.max_batch - 1, 1) * (self.max_k + 1)
        grid = set(range(1, self.max_k + 2))
        r = float(self.max_k + 1)
        while r < top:
            r *= 1.4
            grid.add(min(int(round(r)), top))
        return sorted(grid)

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (
            p.speculative
            and p.structured is None
            and not p.uses_penalties
            and not p.logit_bias  # verification reads the unbiased distribution
            and (p.greedy or p.seed is None)
            and (req.kv_policy is None or not req.kv_policy.bounded)  # a budget makes room one token a step
        )

    def propose(self, running: Sequence[Request]) -> None:
        """Fill ``spec_token_ids`` of the running requests that decode next step (and clear the rest)."""
        if not self.enabled:
            return
        off = len(running) >= self.max_batch  # a large batch is compute-bound: extra tokens cost full price
        lookup = self.proposer.lookup if getattr(self.proposer, "looks_up_first", False) else None
        wants = []
        for req in running:
            req.spec_token_ids = []
            req.spec_draft_probs = None
            if off or req.num_tokens - req.num_computed_tokens != 1 or not self.eligible(req):
                continue
            st = req.spec_state
            if st is None:
                st = req.spec_state = SpecState(self.costs)
            # The step always emits one token of the target's own after the accepted ones: never propose
            # past max_tokens or the context length.
            cap = min(
                self.max_k,
                req.params.max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if cap <= 0:
                continue
            costs = self.batch_costs[len(running)]
            if lookup is not None:  # the proposal first; its match length picks the estimate that prices it
                tokens, match = lookup(req, cap)
                if tokens:
                    req.spec_token_ids = tokens[: st.choose_k(costs, match)]
                continue
            k = min(st.choose_k(costs), cap)
            if k > 0:
                wants.append((req, k))
        if wants:
            try:
                self.proposer.propose(wants)
            except Exception:  # a failing proposer (a draft model's forward) costs speculation, not requests
                log.exception("speculative proposer failed; %d requests decode without proposals", len(wants))
                self.num_proposer_failures += 1
                for req, _ in wants:
                    req.spec_token_ids, req.spec_draft_probs = [], None
                    self.proposer.release(req.request_id)

    def release(self, request_id: str) -> None:
        """The request finished: the proposer gives back what it holds for it (a draft's KV blocks)."""
        if self.enabled:
            self.proposer.release(request_id)

    # -- verification --------------------------------------------------------------------------------
    def sample(
        self,
        structured: Any,
        sampler: Any,
        logits: torch.Tensor,
        reqs: list[Request],
        num_spec: dict[str, int],
        masks: Any,
    ) -> list[tuple[list[int], list[Optional[TokenLogprob]]]]:
        """Tokens (and logprobs) to emit per request, in order. ``num_spec[request_id]`` proposed tokens were
        verified for a request (0 or absent: one logit row, sampled the ordinary way)."""
        rows, plain, start = [], [], 0
        for i, r in enumerate(reqs):
            n = num_spec.get(r.request_id, 0)
            rows.append((start, n))
            if n == 0:
                plain.append(i)
            start += n + 1
        results: list = [None] * len(reqs)
        if plain:
            sel = logits if len(plain) == len(reqs) else logits[[rows[i][0] for i in plain]]
            ids, lps = structured.sample(sampler, sel, [reqs[i] for i in plain], masks)
            for i, t, lp in zip(plain, ids, lps):
                results[i] = ([t], [lp])
        for i, r in enumerate(reqs):
            if results[i] is None:
                s, n = rows[i]
                results[i] = self._verify(sampler, r, logits[s : s + n + 1])
        return results

    @torch.inference_mode()
    def _verify(
        self, sampler: Any, req: Request, rows: torch.Tensor
    ) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        proposed = list(req.spec_token_ids)
        p = req.params
        if p.greedy:
            accepted, nxt = verify_greedy(proposed, argmax(rows).tolist())
        else:
            probs = filter_logits_rows(rows.float() / p.temperature, p).softmax(-1)
            q = req.spec_draft_probs  # None: a deterministic proposal (n-gram)
            q = torch.stack(q[: len(proposed)]).to(probs.device, probs.dtype) if q else None
            accepted, nxt = verify_sampled(proposed, probs, q, sampler.draws_for(req))
        tokens = proposed[:accepted] + [nxt]
        lps: list[Optional[TokenLogprob]] = [None] * len(tokens)
        if p.logprobs is not None:
            raw = rows[: len(tokens)].float().log_softmax(-1)
            for j, t in enumerate(tokens):
                top = []
                if p.logprobs:
                    vals, idx = torch.topk(raw[j], p.logprobs)
                    top = list(zip(idx.tolist(), vals.tolist()))
                lps[j] = TokenLogprob(token_id=t, logprob=float(raw[j, t]), top=top)
        # Rollback: only the last real token and the accepted proposals have valid KV.
        req.num_computed_tokens += accepted
        req.spec_token_ids, req.spec_draft_probs = [], None
        self.kv.trim(req)
        self.num_proposed += len(proposed)
        self.num_accepted += accepted
        self.num_verifications += 1
        self.num_emitted += len(tokens)
        self.acceptance_hist[accepted] += 1
        req.spec_state.update(len(proposed), accepted)
        return tokens, lps

    def counters(self) -> dict[str, Any]:
        return {
            "spec_decode_proposed_tokens": self.num_proposed,
            "spec_decode_proposer_failures": self.num_proposer_failures,
            "spec_decode_step_costs": [round(c, 3) for c in self.costs],
            "spec_decode_accepted_tokens": self.num_accepted,
            "spec_decode_verifications": self.num_verifications,
            "spec_decode_emitted_tokens": self.num_emitted,
            "spec_decode_acceptance_hist": list(self.acceptance_hist),
            **self.proposer.counters(),
        }


def filter_logits_rows(rows: torch.Tensor, p: Any) -> torch.Tensor:
    """top-k / top-p / min-p on every row, exactly as the sampler filters its batch."""
    return filter_logits(rows, p.top_k, p.top_p, p.min_p)
