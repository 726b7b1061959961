"""Draft-model proposer: a smaller checkpoint sharing the target's tokenizer proposes k tokens by
decoding them itself, on our own runner with its own paged KV pool.

Each request that speculates has a shadow ``Request`` in the draft's pool whose tokens are the target's
plus the draft's own proposals. One proposal round:
1. Sync: the target's tokens replace the shadow's. Only the common prefix (the target's earlier tokens
   and the proposals it accepted) keeps its draft KV: the computed count rolls back to it and the blocks
   past it go back to the draft pool.
2. Catch-up: one batched draft forward over every shadow's uncomputed tokens (the target's newest token,
   or a whole prompt the first time, less any draft prefix-cache hit) samples the first proposal.
3. k - 1 batched single-token draft decode steps sample the rest; a request leaves the batch once it
   has its own k.
Greedy requests take the draft's argmax; sampled ones draw from the draft's filtered distribution q at
the request's temperature, and q goes to the verifier with the proposal (rejection sampling with
min(1, p/q) keeps the output distributed as the target alone).

Draft blocks enter the draft's prefix cache only for tokens the target has confirmed, so a rolled-back
proposal never sits in a cached block. When the draft pool is full, the shadows least recently used
are dropped (they are rebuilt, from the prefix cache where it still holds them, when needed again).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch

from sidecar.config import EngineConfig
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.kv_grouped import GroupedKVCacheManager
from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.runner import ModelRunner
from sidecar.engine.sampler import filter_logits
from sidecar.engine.scheduler import ScheduledRequest, SchedulerOutput
from sidecar.model.loader import LoadedModel, load_model

log = logging.getLogger("sidecar.engine")

# A probe the draft's tokenizer must encode exactly as the target's does (ASCII: tokenizer classes of one
# vocabulary may normalise other text differently, which costs acceptance, never exactness).
TOKENIZER_PROBE = 'Speculative decoding: the draft proposes, the target verifies. 1234 + 56 = 1290 {"a": [1]}'


def _shadow_params() -> SamplingParams:
    return SamplingParams(max_tokens=1, ignore_eos=True)


class DraftProposer:
    def __init__(
        self, config: EngineConfig, target: LoadedModel, max_model_len: int, target_blocks: int
    ) -> None:
        name = config.speculative.split(":", 1)[1]
        dcfg = copy.copy(config)
        dcfg.model, dcfg.speculative, dcfg.quantization = name, None, config.speculative_draft_quantization
        # Only requests in batches below speculative_max_batch speculate: the draft pool holds that many
        # sequences of full length (never more tokens than the target's pool).
        per_seq = -(-max_model_len // config.block_size)
        dcfg.num_kv_blocks = min(target_blocks, config.speculative_max_batch * per_seq + 1)
        try:
            self.loaded = load_model(dcfg)
        except ValueError as exc:
            raise ValueError(f"speculative: draft model {name!r}: {exc}") from exc
        if self.loaded.args.linear_layers:  # a rejected proposal would have to roll its state back
            raise ValueError(f"speculative: draft model {name!r} has linear-attention layers (not supported)")
        check_compatible(name, self.loaded, target)
        self.runner = ModelRunner(self.loaded, dcfg)
        if self.runner.kv_plan is not None:  # a draft with KV groups pages them as the target would
            self.kv = GroupedKVCacheManager(
                self.runner.num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                self.runner.kv_plan,
                config.max_num_batched_tokens,
            )
        else:
            self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_batched_tokens = config.max_num_batched_tokens
        self.max_len = self.kv.capacity(self.loaded.max_model_len)
        self.shadows: "OrderedDict[str, Request]" = OrderedDict()  # least recently used first
        self.synced: dict[str, int] = {}  # request id -> the target's token count at the last sync
        self.generator = torch.Generator(device=self.loaded.device)
        self.generator.manual_seed(config.seed + 1)
        self.draft_forwards = 0
        log.info(
            "draft model %s: arch=%s dtype=%s quantization=%s kv_blocks=%d",
            name,
            self.loaded.args.architecture,
            str(self.loaded.dtype).replace("torch.", ""),
            self.loaded.quantization or "none",
            self.kv.num_blocks,
        )

    def step_cost(self, target_step_s: float) -> float:
        """A draft decode step's time relative to the target's (``target_step_s``, timed by the caller),
        measured (0.5 if it cannot be)."""
        t = self.runner.time_decode_rows(1)
        return t[0] / target_step_s if t and target_step_s > 0 else 0.5

    # -- per-request state ----------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.synced.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _sync(self, req: Request) -> Request:
        """The shadow holding the target's tokens, its draft KV rolled back to the common prefix."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, req.all_token_ids, _shadow_params(), cache_salt=req.cache_salt)
            self.shadows[req.request_id] = shadow
        else:
            self.shadows.move_to_end(req.request_id)
            old, new = shadow.all_token_ids, req.all_token_ids
            # The target only appends: its tokens up to the last sync are the shadow's, and past them the
            # shadow holds the draft's proposals, kept as far as the target accepted them.
            common = min(self.synced[req.request_id], shadow.num_computed_tokens)
            limit = min(shadow.num_computed_tokens, len(new))
            while common < limit and old[common] == new[common]:
                common += 1
            del old[common:]
            old.extend(new[common:])
            shadow.num_computed_tokens = common
            self.kv.trim(shadow)
            # Block hashes only ever cover the target's tokens (they are extended here and on a fresh
            # shadow's prefix lookup, never over proposals), so they stay valid across rollbacks.
            self.kv.cache_computed_blocks(shadow)
        self.synced[req.request_id] = req.num_tokens
        return shadow

    def _allocate(self, shadow: Request, n: int, keep: set[str]) -> int:
        """Room for up to n more tokens (a fresh shadow first takes its draft prefix-cache hit), dropping
        least recently used shadows outside ``keep`` when the pool is full. Returns the number of tokens
        the shadow has left to compute within n, or -1 when there is no room."""
        hits: list = []
        if shadow.num_computed_tokens == 0 and not self.kv.req_blocks.get(shadow.request_id):
            hits, num_hit = self.kv.get_computed_blocks(shadow)
            n = min(n, shadow.num_tokens - num_hit)
        while not self.kv.allocate_slots(shadow, n, hits):
            victim = next((rid for rid in self.shadows if rid not in keep), None)
            if victim is None:
                return -1
            self.release(victim)
        shadow.num_computed_tokens += len(hits) * self.kv.block_size
        return n

    # -- proposing ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wants: Sequence[tuple[Request, int]]) -> None:
        """Fill ``spec_token_ids`` (and, for sampled requests, ``spec_draft_probs``) of each request with
        up to its k proposed tokens."""
        active: list[tuple[Request, Request, int, int]] = []
        keep = {r.request_id for r, _ in wants}
        budget = self.max_batched_tokens
        for req, k in wants:
            if req.num_tokens + k > self.max_len:  # past the draft's context: the target decodes alone
                self.release(req.request_id)
                continue
            shadow = self._sync(req)
            need = shadow.num_tokens - shadow.num_computed_tokens
            if need > budget:  # a long catch-up: this step brings the draft closer, proposes nothing
                n = self._allocate(shadow, budget, keep) if budget > 0 else -1
                if n > 0:
                    self._forward([(shadow, n)])
                    budget -= n
                continue
            n = self._allocate(shadow, need, keep)
            if n < 1:
                self.release(req.request_id)
                continue
            budget -= n
            req.spec_draft_probs = None if req.params.greedy else []
            active.append((req, shadow, n, k))
        while active:
            logits = self._forward([(shadow, n) for _, shadow, n, _ in active])
            nxt = []
            for (req, shadow, _, k), row in zip(active, logits):
                tok = self._sample(req, row)
                req.spec_token_ids.append(tok)
                shadow.all_token_ids.append(tok)
                if len(req.spec_token_ids) < k and self.kv.allocate_slots(shadow, 1):
                    nxt.append((req, shadow, 1, k))
            active = nxt

    def _forward(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        sched = SchedulerOutput(scheduled=[ScheduledRequest(s, n) for s, n in batch])
        _, logits = self.runner.execute(sched, self.kv)
        for s, n in batch:
            s.num_computed_tokens += n
        self.draft_forwards += 1
        return logits

    def _sample(self, req: Request, row: torch.Tensor) -> int:
        p = req.params
        if p.greedy:
            return int(row.argmax())
        q = filter_logits(row.float() / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        req.spec_draft_probs.append(q)
        return int(torch.multinomial(q, 1, generator=self.generator).item())

    def counters(self) -> dict[str, Any]:
        return {
            "spec_decode_draft_forwards": self.draft_forwards,
            "spec_decode_draft_kv_blocks_used": self.kv.num_blocks - self.kv.num_free_blocks(),
        }


def check_compatible(name: str, draft: LoadedModel, target: LoadedModel) -> None:
    """The draft must speak the target's token ids: same vocabulary size, same tokenization."""
    if draft.args.vocab_size != target.args.vocab_size:
        raise ValueError(
            f"speculative: draft model {name!r} has a vocabulary of {draft.args.vocab_size} tokens, "
            f"the target {target.args.vocab_size}; the draft must share the target's tokenizer"
        )
    if draft.device != target.device:
        raise ValueError(
            f"speculative: draft model {name!r} loaded on {draft.device}, the target on {target.device}"
        )
    a = draft.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
    b = target.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
    if a != b:
        raise ValueError(
            f"speculative: draft model {name!r} tokenizes text differently from the target; "
            "the draft must share the target's tokenizer"
        )
