"""GroupedKVCacheManager: a block table per KV group (``kv_groups.py``) for each sequence, over one pool.

Every table of a sequence has one entry per block of its positions; a sliding or chunked group's entries
before the block of ``first_needed`` of the sequence's next query are ``NULL`` and their blocks are back in
the pool (``_release``). ``req_blocks`` keeps group 0's table (a full group when the model has one), the
table ``block_ids`` returns by default. No eviction policy, offload tier or state slot applies to a grouped
model (``build`` refuses them; the engine refuses budgets for windowed models).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from sidecar.engine.block_pool import KVBlock
from sidecar.engine.kv_cache import KVCacheManager, _parent
from sidecar.engine.kv_groups import NULL, GroupPlan, capacity_tokens, group_key
from sidecar.engine.request import Request

log = logging.getLogger("sidecar.engine")


def build_kv_manager(config, runner, loaded) -> KVCacheManager:
    """The KV manager of ``runner``'s pool: a ``GroupedKVCacheManager`` where the runner pages KV groups (no
    offload tiers then, logged), else ``KVCacheManager.build``."""
    if runner.kv_plan is None:
        return KVCacheManager.build(config, runner, loaded)
    if config.enable_prefix_caching and (config.kv_offload_gb > 0 or config.kv_offload_dir):
        log.warning("KV offload off: a model with KV groups keeps no offload tiers")
    mgr = GroupedKVCacheManager(
        runner.num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        runner.kv_plan,
        config.max_num_batched_tokens,
    )
    mgr.copy_blocks = runner.copy_blocks
    return mgr


class GroupHits(list):
    """The hit ``get_computed_blocks`` returns: group 0's blocks, with every group's in ``per_group``."""

    per_group: list[list[KVBlock]]


class GroupedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, plan: GroupPlan, chunk: int):
        """``chunk``: the most tokens one step adds to a sequence (the token budget), for the capacity."""
        super().__init__(num_blocks, block_size, enable_caching)
        self.plan = plan
        self.groups = plan.groups
        self.tables: dict[str, list[list[KVBlock]]] = {}
        self.null = self.pool.blocks[NULL]
        self.chunk = chunk
        self.num_released_blocks = 0  # blocks given back by sliding / chunked groups as sequences moved on

    def capacity(self, cap: int) -> int:
        return capacity_tokens(self.plan, self.pool.num_usable_blocks, self.block_size, self.chunk, cap)

    def _tables(self, req: Request) -> list[list[KVBlock]]:
        t = self.tables.get(req.request_id)
        if t is None:
            t = self.tables[req.request_id] = [[] for _ in self.groups]
            self.req_blocks[req.request_id] = t[0]
        return t

    # -- prefix cache -------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        if not self.enable_caching:
            return [], 0
        self._update_hashes(req)
        bs, toks = self.block_size, req.all_token_ids
        m = (req.num_tokens - 1) // bs
        while m > 0:
            per_group = [self._group_hit(req, g, m, toks) for g in range(len(self.groups))]
            if all(h is not None for h in per_group):
                break
            m -= 1
        self.prefix_queries += req.num_tokens
        if m == 0:
            return [], 0
        self.prefix_hits += m * bs
        hits = GroupHits(per_group[0])
        hits.per_group = per_group
        return hits, m * bs

    def _group_hit(self, req: Request, g: int, m: int, toks: list[int]) -> Optional[list[KVBlock]]:
        """Group ``g``'s blocks of an ``m``-block hit (``NULL`` before its needed ones), or None."""
        bs = self.block_size
        first = self.groups[g].first_needed(m * bs) // bs
        out = [self.null] * first
        for i in range(first, m):
            block = self.pool.get_cached(
                group_key(req.block_hashes[i], g), tuple(toks[i * bs : (i + 1) * bs])
            )
            if block is None:
                return None
            out.append(block)
        return out

    def cache_computed_blocks(self, req: Request) -> None:
        if not self.enable_caching:
            return
        self._update_hashes(req)
        tables = self.tables.get(req.request_id)
        if not tables:
            return
        bs, toks = self.block_size, req.all_token_ids
        for g, blocks in enumerate(tables):
            n_full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(blocks))
            for i in range(n_full - 1, -1, -1):
                block = blocks[i]
                if block is self.null or block.block_hash is not None:
                    break  # earlier blocks are released or were registered in an earlier step
                parent = _parent(req, i)
                self.pool.cache_block(
                    block,
                    group_key(req.block_hashes[i], g),
                    tuple(toks[i * bs : (i + 1) * bs]),
                    None if parent is None else group_key(parent, g),
                )

    # -- allocation -----------------------------------------------------------
    def _release(self, req: Request, tables: list[list[KVBlock]], pos: int) -> None:
        """Give back every block of a sliding / chunked group wholly before what a query at ``pos`` sees."""
        bs = self.block_size
        for g, blocks in zip(self.groups, tables):
            stop = min(len(blocks), g.first_needed(pos) // bs)
            gone = [b for b in blocks[:stop] if b is not self.null]
            if gone:
                blocks[:stop] = [self.null] * stop
                self.pool.free(gone)
                self.num_released_blocks += len(gone)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """As ``KVCacheManager.allocate_slots`` for every group; blocks no future query of ``req`` can see
        are given back first (that changes nothing the request can read)."""
        bs = self.block_size
        tables = self._tables(req)
        hits = getattr(new_computed_blocks, "per_group", None) or [[] for _ in self.groups]
        start = req.num_computed_tokens + len(new_computed_blocks) * bs  # the step's earliest query
        if not hits[0]:
            self._release(req, tables, start)
        total = start + num_new_tokens
        need = sum(-(-total // bs) - len(t) - len(h) for t, h in zip(tables, hits))
        revived = sum(1 for h in hits for b in h if b is not self.null and b.ref_cnt == 0)
        c = req.num_computed_tokens
        cows = [g for g, t in enumerate(tables) if c % bs and c // bs < len(t) and t[c // bs].ref_cnt > 1]
        if need + len(cows) > self.pool.num_free_blocks() - revived:
            return False
        for g in cows:
            self._cow(tables[g], c // bs)
        for t, h in zip(tables, hits):  # every group's hit leaves the free queue before any allocation
            self.pool.touch(b for b in h if b is not self.null)
            t.extend(h)
        for t in tables:
            more = -(-total // bs) - len(t)
            if more > 0:
                t.extend(self.pool.allocate(more))
        return True

    def _cow(self, blocks: list[KVBlock], i: int) -> None:
        if self.copy_blocks is None:
            raise RuntimeError("copy-on-write of a shared KV block needs the runner's block copy")
        (copy,) = self.pool.allocate(1)
        self.copy_blocks([blocks[i].block_id], [copy.block_id])
        self.pool.free([blocks[i]])
        blocks[i] = copy
        self.num_cow_copies += 1

    def evict(self, req: Request, n: int) -> int:
        if req.kv_policy is not None:
            raise ValueError("kv_budget: not available for a model with sliding-window or chunked layers")
        return n

    def fork(self, parent: Request, child: Request) -> None:
        tables = [list(t) for t in self.tables.get(parent.request_id, [[] for _ in self.groups])]
        for t in tables:
            self.pool.touch(b for b in t if b is not self.null)
        self.tables[child.request_id] = tables
        self.req_blocks[child.request_id] = tables[0]

    def trim(self, req: Request) -> None:
        keep = -(-req.num_computed_tokens // self.block_size)
        for t in self.tables.get(req.request_id, ()):
            if len(t) > keep:
                tail = [b for b in t[keep:] if b is not self.null]
                del t[keep:]
                self.pool.free(reversed(tail))

    def free(self, req: Request) -> None:
        self.req_blocks.pop(req.request_id, None)
        for t in self.tables.pop(req.request_id, ()):
            self.pool.free(reversed([b for b in t if b is not self.null]))

    def block_ids(self, req: Request, group: int = 0) -> list[int]:
        tables = self.tables.get(req.request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def held_blocks(self, req: Request) -> list[int]:
        """Per group, how many pool blocks ``req`` holds (``NULL`` entries not counted)."""
        return [sum(b is not self.null for b in t) for t in self.tables.get(req.request_id, ())]
