"""Bounded KV per sequence: which whole blocks a sequence gives back while it runs.

A sequence under a policy keeps a subset of its blocks. Only full blocks are ever evicted, so the tokens it
keeps stay contiguous in its block table: the table lists the kept blocks only, and a kept token's index in
the table (its *cache index*) is its position minus ``Request.kv_evicted`` for every token written after the
last eviction. New tokens therefore go to cache index ``num_computed_tokens - kv_evicted`` while their rope
position stays ``num_computed_tokens`` (rope is applied at write time, so kept keys keep the positions they
were encoded at); attention kernels see a dense context of ``ctx - kv_evicted`` kept tokens and need no
knowledge of eviction.

Policies (``EvictionPolicy.kind``):
- ``streaming``: sinks (the first block: the first ``SINK_TOKENS`` tokens rounded up to a block) and the
  most recent blocks; over the budget the oldest block between them goes.
- ``h2o``: sinks and a recent window are kept; over the budget the block between them whose tokens
  received the least attention per query goes (summed over heads and layers, divided by the queries the
  sequence has sent since the token was written: ``kv_scores.py``). A slot's score restarts when a token is
  written into it; a block taken from the prefix cache keeps what it received before, and a block shared by
  several sequences sums what each gave it. One step evicts at most ``step_blocks`` blocks, so a long
  prompt is computed in chunks that each leave the ranking something to choose from.
- ``window``: a model whose every layer has a sliding window: blocks wholly before the window of the next
  query are freed (no sinks, no budget). The window mask already hides them, so output is unchanged.

A budget of ``B`` blocks protects ``S`` sink blocks and ``W = max(1, (B - S) // 2)`` recent blocks (the
last, partly filled block among them), so a step can always add at least one block's worth of tokens after
evicting everything between them; a budget smaller than ``S + 2`` blocks is refused. A prompt chunk of a
budgeted sequence is capped so that its kept tokens plus the chunk fit the budget.

KV written after a sequence's first eviction was computed over a partial context and is not what a
block's prefix hash says, so such a sequence publishes no more blocks to the prefix cache
(``KVCacheManager.cache_computed_blocks``); blocks it published before stay correct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from sidecar.engine.block_pool import KVBlock

SINK_TOKENS = 4
KV_EVICTIONS = ("h2o", "streaming")


@dataclass(frozen=True)
class EvictionPolicy:
    kind: str  # "h2o" | "streaming" | "window"
    budget_blocks: Optional[int]  # None for "window"
    sink_blocks: int
    window_blocks: int  # recent blocks never evicted ("window": 0, the window is in tokens)
    sliding_window: Optional[int] = None  # "window": the model's window in tokens

    @property
    def scored(self) -> bool:
        """Whether this policy needs the attention each cached token receives."""
        return self.kind == "h2o"

    @property
    def bounded(self) -> bool:
        """Whether a sequence's KV is bounded by a budget (it may then outgrow the pool's size)."""
        return self.budget_blocks is not None


def is_scored(req: Any) -> bool:
    """Whether request ``req`` runs under a scored policy (its steps add up the attention its keys receive)."""
    return req.kv_policy is not None and req.kv_policy.scored


def min_budget(block_size: int) -> int:
    """The smallest budget in tokens: the sinks, one recent block and one evictable block."""
    return (_sink_blocks(block_size) + 2) * block_size


def _sink_blocks(block_size: int) -> int:
    return -(-SINK_TOKENS // block_size)


def budget_policy(kind: str, budget: int, block_size: int, field: str = "kv_budget") -> EvictionPolicy:
    """The policy of a ``budget`` of tokens (rounded down to whole blocks); ValueError naming ``field``
    (or ``kv_eviction`` for an unknown kind)."""
    if kind not in KV_EVICTIONS:
        raise ValueError(f"kv_eviction: must be one of {', '.join(KV_EVICTIONS)}, got {kind!r}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < min_budget(block_size):
        raise ValueError(
            f"{field}: must be at least {min_budget(block_size)} tokens (sinks, a recent window and one "
            f"block of {block_size} tokens), got {budget!r}"
        )
    b = budget // block_size
    s = _sink_blocks(block_size)
    return EvictionPolicy(kind, b, s, max(1, (b - s) // 2))


def window_policy(window: int) -> EvictionPolicy:
    return EvictionPolicy("window", None, 0, 0, window)


def step_blocks(policy: EvictionPolicy) -> int:
    """The most blocks one step of a scored sequence evicts: a quarter of the blocks between its sinks and
    its window, so each eviction still chooses among several candidates per block it drops (a prompt chunk
    that needed every candidate gone would leave nothing to choose and evict exactly as ``streaming``)."""
    return max(1, (policy.budget_blocks - policy.sink_blocks - policy.window_blocks) // 4)


def cap_new_tokens(policy: EvictionPolicy, kept_tokens: int, num_blocks: int, n: int, bs: int) -> int:
    """The most of ``n`` new tokens a sequence holding ``kept_tokens`` in ``num_blocks`` blocks can take
    this step once the blocks it may evict in one step are gone: every evictable block (``streaming``) or
    at most ``step_blocks`` of them (``h2o``); at least one block's worth (see the module doc)."""
    if not policy.bounded:
        return n
    evictable = max(0, num_blocks - policy.sink_blocks - policy.window_blocks)
    if policy.scored:
        evictable = min(evictable, step_blocks(policy))
    return min(n, (policy.budget_blocks + evictable) * bs - kept_tokens)


def choose_victims(
    policy: EvictionPolicy,
    blocks: list["KVBlock"],
    evicted: int,
    computed: int,
    n: int,
    bs: int,
    lowest: Optional[Callable[[list[int], int, int], list[int]]],
) -> list[int]:
    """Indices into ``blocks`` (a sequence's kept blocks; ``evicted`` tokens gone, ``computed`` tokens
    computed) to evict before it adds ``n`` tokens (already capped by ``cap_new_tokens``), ascending.
    ``lowest(block_ids, computed, k)``: indices into ``block_ids`` of the ``k`` least attended blocks
    (``kv_scores.SlotScores.lowest``), asked only when an eviction is due."""
    kept = computed - evicted
    if policy.kind == "window":
        # "window" evicts leading blocks only, so kept block i holds positions evicted + i * bs onwards. A key
        # at or before (next query - window) is masked for this and every later query.
        first_visible = computed - policy.sliding_window
        out = []
        for i in range(len(blocks) - 1):
            if evicted + (i + 1) * bs > first_visible:
                break
            out.append(i)
        return out
    excess = -(-(kept + n) // bs) - policy.budget_blocks
    lo, hi = policy.sink_blocks, len(blocks) - policy.window_blocks
    if excess <= 0 or hi <= lo:
        return []
    if policy.scored and lowest is not None:
        # Lowest mean attention first; on a tie the older block goes.
        chosen = lowest([blocks[i].block_id for i in range(lo, hi)], computed, excess)
        return sorted(lo + j for j in chosen)
    return list(range(lo, min(hi, lo + excess)))


class KVPolicies:
    """The engine's eviction settings, resolved per request (``for_params``).

    ``windows``: each layer's sliding window (None: full attention). A model whose every layer has one runs
    every sequence under the ``window`` policy; a budget is refused for a model with any windowed layer
    (its cache index would no longer be its position less a constant, which the window mask assumes)."""

    def __init__(
        self,
        budget: Optional[int],
        eviction: str,
        block_size: int,
        windows: list[Optional[int]],
        grouped: bool = False,
    ):
        """``grouped``: the model pages KV groups (kv_groups.py), whose tables a budget would not bound."""
        self.budget, self.eviction, self.block_size = budget, eviction, block_size
        self.windowed = grouped or any(w is not None for w in windows)
        self.window = window_policy(max(windows)) if windows and all(w is not None for w in windows) else None
        if budget is not None:
            self._refuse_windowed("kv_budget")
            budget_policy(eviction, budget, block_size)  # ValueError naming kv_budget / kv_eviction

    @classmethod
    def for_model(cls, config: Any, args: Any, grouped: bool) -> "KVPolicies":
        """The policies of an engine ``config`` for a model of ``args`` (its layers' windows)."""
        windows = [args.window(i) for i in range(args.num_layers)]
        return cls(config.kv_budget, config.kv_eviction, config.block_size, windows, grouped)

    def _refuse_windowed(self, field: str) -> None:
        if self.windowed:
            raise ValueError(
                f"{field}: not available for a model with sliding-window or chunked attention layers (they "
                "free the blocks outside their window or chunk by themselves)"
            )

    def for_params(self, params: Any) -> Optional[EvictionPolicy]:
        """The policy of a request with these SamplingParams; ValueError naming the field at fault."""
        budget = params.kv_budget if params.kv_budget is not None else self.budget
        if params.kv_budget is not None or params.kv_eviction is not None:
            self._refuse_windowed("kv_budget" if params.kv_budget is not None else "kv_eviction")
        if budget is None:
            if params.kv_eviction is not None:
                raise ValueError("kv_eviction: needs a kv_budget (none is set for the request or the engine)")
            return self.window
        return budget_policy(params.kv_eviction or self.eviction, budget, self.block_size)
