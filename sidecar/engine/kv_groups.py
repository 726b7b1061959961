"""KV cache groups: layers of different attention kinds (full, sliding window, chunked) each with their own
block table per sequence, all drawn from one block pool.

Layout. A model whose attention layers are of several kinds (Gemma 2/3 and gpt-oss: sliding and full; Llama 4:
chunked and full) and whose layers all keep K/V of one shape is split into groups of ``k`` layers of one kind,
``k`` the greatest common divisor of the kinds' layer counts (so every group holds the same number of
layers). The runner allocates ``k`` cache tensors and the ``j``-th layer of every group reads and writes the
``j``-th of them, so a pool block is a page of ``k`` layers' K/V owned by exactly one group of one sequence
(or shared by prefix reuse within that group): one pool, one page size, one token budget.

Freeing. A block of a sliding group (window ``W``) whose every position is before ``p - W + 1``, ``p`` the
earliest query position of the sequence's next step (a prompt chunk or the verified tokens of a speculative
step start there), is masked for that and every later query; so is a chunked group's block wholly before
the chunk of ``p``. ``GroupedKVCacheManager.allocate_slots`` returns such blocks to the pool and points their
table entries at the reserved padding block 0 (``NULL``), which holds finite data and is never written by a
grouped step: every attention path masks those positions by window or chunk, so no freed block is read as
data, and a sequence's table keeps one entry per block of its positions (a token's slot stays
``table[p // block_size] * block_size + p % block_size``).

Prefix caching. Each group publishes its own full blocks under the sequence's chained block hash keyed by
the group (``group_key``). A hit of ``m`` blocks needs, in every full group, the blocks ``0..m-1``, and in a
sliding or chunked group only the blocks the next query can see (from the block of ``first_needed(m * bs)``
to ``m - 1``); the entries before are ``NULL``. Shorter hits are tried until every group has its blocks, so
a hit is exact: each block it serves holds the K/V its chained hash names.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("sidecar.engine")

NULL = 0  # the pool's reserved padding block: what a freed table entry points at


@dataclass(frozen=True)
class KVGroup:
    kind: str  # "full" | "sliding" | "chunked"
    span: Optional[int]  # the window (sliding) or chunk (chunked) in tokens; None for full
    layers: tuple[int, ...]

    def first_needed(self, pos: int) -> int:
        """The first position a query at ``pos`` (or any later one) may attend."""
        if self.kind == "sliding":
            return max(0, pos - self.span + 1)
        if self.kind == "chunked":
            return pos // self.span * self.span
        return 0

    def max_blocks(self, block_size: int, new_tokens: int) -> Optional[int]:
        """Most blocks a sequence holds in this group while a step adds ``new_tokens`` (None: unbounded)."""
        if self.kind == "full":
            return None
        return -(-(self.span - 1 + new_tokens) // block_size) + 1


@dataclass(frozen=True)
class GroupPlan:
    groups: tuple[KVGroup, ...]
    per_group: int  # layers per group: the number of cache tensors the layers share

    def storage_of(self, num_layers: int) -> list[int]:
        """Per layer, the index of the cache tensor it reads and writes."""
        out = [0] * num_layers
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                out[layer] = j
        return out

    def group_of(self) -> list[int]:
        """Per layer, the index of its group."""
        out = [0] * sum(len(g.layers) for g in self.groups)
        for i, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = i
        return out

    def describe(self) -> str:
        kinds = ", ".join(f"{g.kind}{'' if g.span is None else f' {g.span}'}" for g in self.groups)
        return f"{len(self.groups)} groups of {self.per_group} layers ({kinds})"


def plan_groups(args, tp_pp: int = 1) -> tuple[Optional[GroupPlan], Optional[str]]:
    """The groups of a model's layers, or (None, reason) when it keeps one table per sequence: a single
    attention kind (a model whose every layer has a window frees through ``kv_evict``'s window policy), or
    a layout groups cannot page (reason logged by the caller)."""
    if not hasattr(args, "window"):  # arguments without per-layer attention kinds
        return None, None
    n = args.num_layers
    kinds = [_kind(args, i) for i in range(n)]
    if len(set(kinds)) < 2:
        return None, None
    if args.latent is not None or args.linear_layers:
        return None, "latent or linear-attention layers"
    if args.kv_source is not None and any(args.kv_source[i] != i for i in range(n)):
        return None, "layers sharing another layer's KV"
    if len(set(args.kv_shapes())) != 1:
        return None, "layers with different KV shapes"
    if tp_pp > 1:
        return None, "tensor / pipeline parallel ranks"
    order = list(dict.fromkeys(kinds))
    members = {k: [i for i in range(n) if kinds[i] == k] for k in order}
    k = math.gcd(*(len(v) for v in members.values()))
    groups = []
    for kind in sorted(order, key=lambda x: x[0] != "full"):  # full groups first
        layers = members[kind]
        for s in range(0, len(layers), k):
            groups.append(KVGroup(kind[0], kind[1], tuple(layers[s : s + k])))
    return GroupPlan(tuple(groups), k), None


def _kind(args, layer: int) -> tuple[str, Optional[int]]:
    chunk, window = args.chunk(layer), args.window(layer)
    if chunk is not None:
        return "chunked", chunk
    if window is not None:
        return "sliding", window
    return "full", None


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a group's block (group 0 keeps the plain chained hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def blocks_per_sequence(plan: GroupPlan, block_size: int, tokens: int, chunk: int) -> int:
    """Blocks one sequence of ``tokens`` holds over every group while a step adds up to ``chunk`` tokens."""
    full = -(-tokens // block_size)
    total = 0
    for g in plan.groups:
        bound = g.max_blocks(block_size, chunk)
        total += full if bound is None else min(full, bound)
    return total


def capacity_tokens(plan: GroupPlan, usable_blocks: int, block_size: int, chunk: int, cap: int) -> int:
    """The longest sequence (at most ``cap`` tokens) whose blocks over every group fit ``usable_blocks``."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_per_sequence(plan, block_size, mid, chunk) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
