"""KV cache groups: layers of different attention kinds (full, sliding window, chunked) each with their own
block table per sequence, all drawn from one block pool.

Layout. A model whose attention layers are of several kinds (Gemma 2/3 and gpt-oss: sliding and full; Llama 4:
chunked and full; Gemma 4: sliding and full, each kind at its own KV heads and head size) is split into groups
of ``k`` layers of one kind and one cache shape, ``k`` the greatest common divisor of the layer counts of each
(kind, shape) (so every group holds the same number of layers). The runner allocates ``k`` cache tensors per
cache shape (``GroupPlan.shapes``) and the ``j``-th layer of every group of a shape reads and writes that
shape's ``j``-th tensor, so a pool block is a page of ``k`` layers' K/V owned by exactly one group of one
sequence (or shared by prefix reuse within that group): one pool, one page size, one token budget. With
several shapes a block id holds a page in every shape's tensors and its group uses the one of its shape (the
others' stay unused: a block costs the sum of the shapes' pages). A layer reading an earlier layer's cache
(``kv_source``: Gemma 4's KV-sharing layers) keeps none: it is a reader of its source's group, attending
through that group's tables on its source's tensor.

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
    layers: tuple[int, ...]  # the layers keeping this group's KV: the j-th on tensor j of its shape
    shape: Optional[tuple[int, int]] = None  # (KV heads, head size) of its layers' caches; None: the model's
    readers: tuple[tuple[int, int], ...] = ()  # (layer, source): layers attending on a source's cache

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
    per_group: int  # layers keeping KV per group: the number of cache tensors of each shape
    shapes: tuple[tuple[int, int], ...] = ()  # the cache shapes, in storage order (): one, the model's

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) + len(g.readers) for g in self.groups)

    def storage_of(self, num_layers: Optional[int] = None) -> list[int]:
        """Per layer, the index of the cache tensor it reads (and, keeping KV, writes): ``per_group`` tensors
        per shape in ``shapes`` order, a group's ``j``-th layer on its shape's ``j``-th, a reader on its
        source's."""
        out = [0] * (num_layers or self.num_layers)
        for g in self.groups:
            base = self.shapes.index(g.shape) * self.per_group if self.shapes else 0
            for j, layer in enumerate(g.layers):
                out[layer] = base + j
        for g in self.groups:
            for layer, source in g.readers:
                out[layer] = out[source]
        return out

    def group_of(self) -> list[int]:
        """Per layer, the index of its group (a reader's is its source's)."""
        out = [0] * self.num_layers
        for i, g in enumerate(self.groups):
            for layer in (*g.layers, *(r for r, _ in g.readers)):
                out[layer] = i
        return out

    def describe(self) -> str:
        kinds = ", ".join(
            f"{g.kind}{'' if g.span is None else f' {g.span}'}"
            + ("" if len(self.shapes) < 2 else f" {g.shape[0]}x{g.shape[1]}")
            + (f" +{len(g.readers)} reading" if g.readers else "")
            for g in self.groups
        )
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
    src = args.kv_source or tuple(range(n))
    if any(kinds[src[i]] != kinds[i] for i in range(n)):
        return None, "a layer reading the KV of a layer of another attention kind"
    if tp_pp > 1:
        return None, "tensor / pipeline parallel ranks"
    owners = [i for i in range(n) if src[i] == i]
    shape = dict(zip(owners, args.kv_shapes()))  # kv_shapes lists the layers keeping KV, in order
    keys = [(*kinds[i], shape[i]) for i in owners]
    order = list(dict.fromkeys(keys))
    members = {key: [i for i, x in zip(owners, keys) if x == key] for key in order}
    k = math.gcd(*(len(v) for v in members.values()))
    groups = []
    for key in sorted(order, key=lambda x: x[0] != "full"):  # full groups first
        layers = members[key]
        for s in range(0, len(layers), k):
            mine = tuple(layers[s : s + k])
            readers = tuple((i, src[i]) for i in range(n) if src[i] != i and src[i] in mine)
            groups.append(KVGroup(key[0], key[1], mine, key[2], readers))
    return GroupPlan(tuple(groups), k, tuple(dict.fromkeys(shape[i] for i in owners))), None


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
