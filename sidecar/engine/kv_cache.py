"""KVCacheManager: per-request block tables over the shared BlockPool, with prefix caching and (given
a ``KVOffload``) a second tier that keeps evicted prefix blocks and loads them back on a later hit."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from sidecar.config import EngineConfig
from sidecar.engine.block_pool import BlockPool, KVBlock, hash_block
from sidecar.engine.kv_evict import cap_new_tokens, choose_victims
from sidecar.engine.kv_offload import KVOffload, model_identity, offload_stats
from sidecar.engine.linear_state import OFFLOAD_REASON, SlotPool, StateCheckpoints
from sidecar.engine.request import Request

log = logging.getLogger("sidecar.engine")


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        offload: Optional[KVOffload] = None,
        slots: Optional[SlotPool] = None,
    ) -> None:
        """``slots``: a hybrid model's linear-attention state slots (linear_state.py); a sequence holds one
        from its first allocation until ``free``. With prefix caching its states are checkpointed at block
        ends and a hit is served only up to the last block with a checkpoint (``StateCheckpoints``)."""
        self.block_size = block_size
        self.slots = slots
        self.enable_caching = enable_caching
        self.ckpts = StateCheckpoints(slots.states) if slots is not None and enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching)
        self.offload = offload if enable_caching else None
        if self.offload is not None:
            self.pool.on_evict = self._offload_evicted
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Copies block src over block dst in the KV tensors (ModelRunner.copy_blocks): copy-on-write.
        self.copy_blocks: Optional[Callable[[list[int], list[int]], None]] = None
        self.num_cow_copies = 0
        # The k least attended of these blocks for a sequence at this many tokens (ModelRunner.lowest_blocks):
        # h2o.
        self.lowest_blocks: Optional[Callable[[list[int], int, int], list[int]]] = None
        self.num_evicted_blocks = 0  # blocks given back by sequences under an eviction policy
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens served from cache

    @classmethod
    def build(cls, config: EngineConfig, runner, loaded) -> "KVCacheManager":
        """The manager of ``runner``'s pool, with the offload tiers the config asks for."""
        offload = None
        caching = config.enable_prefix_caching
        tiers = config.kv_offload_gb > 0 or config.kv_offload_dir
        if caching and tiers and runner.states is not None:
            log.warning("KV offload off: %s", OFFLOAD_REASON)
            tiers = False
        if caching and tiers:
            identity = model_identity(loaded, runner.kv_info()["kv_cache_dtype"], config.block_size)
            offload = KVOffload(
                int(config.kv_offload_gb * (1 << 30)),
                config.kv_offload_dir,
                int(config.kv_offload_disk_gb * (1 << 30)),
                identity,
                runner.read_block,
                runner.write_blocks,
            )
        slots = SlotPool(runner.states) if runner.states is not None else None
        mgr = cls(runner.num_blocks, config.block_size, caching, offload, slots)
        mgr.copy_blocks = runner.copy_blocks
        mgr.lowest_blocks = runner.lowest_blocks
        return mgr

    def _offload_evicted(self, block: KVBlock) -> None:
        """``BlockPool.on_evict``: the block goes to the tiers, and so do the blocks before it in its chain
        that are still in the pool and not yet on disk. The pool evicts a chain's tail first, so its head
        may never leave; a lookup walks a chain from its first block, so without the head a restart (which
        finds only the disk) could reach none of it."""
        self.offload.offload(block.block_id, block.block_hash, block.token_ids)
        disk = self.offload.disk
        parent = block.parent_hash
        while disk is not None and disk.enabled and parent is not None and parent not in disk.files:
            head = self.pool.cached.get(parent)
            if head is None:
                break
            self.offload.offload(head.block_id, head.block_hash, head.token_ids, disk_only=True)
            parent = head.parent_hash

    def offload_stats(self) -> dict:
        """The offload tiers' counters (all zero without tiers)."""
        return offload_stats(self.offload)

    # -- prefix cache -------------------------------------------------------
    def _update_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        toks = req.all_token_ids
        while (len(hashes) + 1) * bs <= len(toks):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(toks[i * bs : (i + 1) * bs]), req.cache_salt))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest chain of cached blocks matching the request's leading tokens.

        Never covers the last token: it must be recomputed to produce logits.
        Returns (blocks, number of tokens they hold)."""
        if not self.enable_caching or (self.ckpts is not None and req.kv_policy is not None):
            return [], 0  # a policy may trim the hit to a block without a state checkpoint
        self._update_hashes(req)
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        toks = req.all_token_ids
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached(req.block_hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        if self.offload is not None and len(hits) < max_blocks:
            hits += self._load_offloaded(req, hits, max_blocks)
        if self.ckpts is not None:  # the linear layers' state is restored after the last hit block
            while hits and not self.ckpts.has(req.block_hashes[len(hits) - 1]):
                hits.pop()
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def _load_offloaded(self, req: Request, hits: list[KVBlock], stop: int) -> list[KVBlock]:
        """Continue the chain of ``hits`` from the offload tiers: each found block is loaded into a fresh pool
        block registered under its hash and left free (ref 0), like a freed cached block, so the caller
        treats it as a hit. Stops at the first block no tier has (the pool untouched by that miss), or when
        the pool has no free block."""
        bs = self.block_size
        toks = req.all_token_ids
        self.pool.touch(hits)  # the chain found so far must not become a load target
        found: list[tuple[int, tuple[int, ...], torch.Tensor]] = []
        for i in range(len(hits), min(stop, len(hits) + self.pool.num_free_blocks())):
            tokens = tuple(toks[i * bs : (i + 1) * bs])
            data = self.offload.fetch(req.block_hashes[i], tokens)  # a miss leaves the pool untouched
            if data is None:
                break
            found.append((i, tokens, data))
        loaded: list[KVBlock] = []
        try:
            if found:
                loaded = self.pool.allocate(len(found))
                if self.offload.install([b.block_id for b in loaded], [d for _, _, d in found]):
                    for block, (i, tokens, _) in zip(loaded, found):
                        self.pool.cache_block(block, req.block_hashes[i], tokens, _parent(req, i))
        finally:
            # Back to ref 0 (later blocks of a chain are evicted first, as in free()); blocks whose install
            # failed were never registered, so they are plain free space again and not returned as hits.
            self.pool.free(reversed(loaded))
            self.pool.free(reversed(hits))
        return [b for b in loaded if b.block_hash is not None]

    # -- allocation -----------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed (and newly hit) tokens.

        Returns False, changing nothing, when the pool cannot supply the blocks."""
        bs = self.block_size
        blocks = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens - req.kv_evicted + len(new_computed_blocks) * bs + num_new_tokens
        need = -(-total // bs) - len(blocks) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being allocatable once we take them.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        # The first write into a partly filled block that a fork shares is a write into a copy of it.
        c = req.num_computed_tokens - req.kv_evicted
        cow = c // bs if c % bs and c // bs < len(blocks) and blocks[c // bs].ref_cnt > 1 else None
        if need + (cow is not None) > self.pool.num_free_blocks() - revived:
            return False
        if self.slots is not None and not self.slots.take(req.request_id):
            return False  # every state slot is held (a sequence cannot run without one)
        if self.ckpts is not None and new_computed_blocks:  # a hit: its state, not rest
            self.ckpts.restore(req.block_hashes[len(new_computed_blocks) - 1], self.state_slot(req))
        if cow is not None:
            self._copy_on_write(blocks, cow)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self.req_blocks[req.request_id] = blocks
        return True

    def evict(self, req: Request, n: int) -> int:
        """Under ``req.kv_policy``, give back the blocks its policy drops before it adds ``n`` tokens, and
        return how many of them it can take this step (``n`` or fewer: a prompt chunk is capped so that it
        fits the budget). Without a policy: ``n``, nothing changed."""
        policy = req.kv_policy
        if policy is None:
            return n
        blocks = self.req_blocks.get(req.request_id)
        bs = self.block_size
        n = cap_new_tokens(policy, req.num_computed_tokens - req.kv_evicted, len(blocks or ()), n, bs)
        if blocks:
            victims = choose_victims(
                policy, blocks, req.kv_evicted, req.num_computed_tokens, n, bs, self.lowest_blocks
            )
            if victims:
                gone = [blocks[i] for i in victims]
                for i in reversed(victims):
                    del blocks[i]
                self.pool.free(gone)
                req.kv_evicted += len(gone) * bs
                self.num_evicted_blocks += len(gone)
        return n

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the blocks of ``parent`` by reference (one more reference each): a beam that forks
        shares its whole prefix; a later write into a shared, partly filled block copies that block first
        (``allocate_slots``), and full blocks are never written again."""
        blocks = list(self.req_blocks.get(parent.request_id, ()))
        if self.slots is not None:
            self.slots.fork(parent.request_id, child.request_id)
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks

    def _copy_on_write(self, blocks: list[KVBlock], i: int) -> None:
        if self.copy_blocks is None:
            raise RuntimeError("copy-on-write of a shared KV block needs the runner's block copy")
        shared = blocks[i]
        (copy,) = self.pool.allocate(1)
        self.copy_blocks([shared.block_id], [copy.block_id])
        blocks[i] = copy
        self.pool.free([shared])
        self.num_cow_copies += 1

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (after a step ran)."""
        if not self.enable_caching or req.kv_evicted:
            return  # after an eviction its blocks no longer hold what their prefix hashes say
        self._update_hashes(req)
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        bs = self.block_size
        toks = req.all_token_ids
        n_full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(blocks))
        for i in range(n_full - 1, -1, -1):
            block = blocks[i]
            if block.block_hash is not None:
                break  # earlier blocks were registered in an earlier step
            self.pool.cache_block(
                block, req.block_hashes[i], tuple(toks[i * bs : (i + 1) * bs]), _parent(req, i)
            )
        k = req.num_computed_tokens // bs
        if self.ckpts is not None and req.num_computed_tokens % bs == 0 and 0 < k <= len(req.block_hashes):
            # the slot's state is the state right after block k - 1 (it has consumed exactly k blocks)
            self.ckpts.save(req.block_hashes[k - 1], self.state_slot(req))

    def chunk_end(self, req: Request, start: int, n: int) -> int:
        """How many of ``n`` prompt tokens from ``start`` a chunk takes: with state checkpoints, a chunk
        that would cross the prompt's last full block a hit can cover ends there, so that the state after
        that block is checkpointed (a state exists only at a chunk's end). ``n`` otherwise."""
        if self.ckpts is None or n <= 1:
            return n
        end = (req.num_tokens - 1) // self.block_size * self.block_size
        return end - start if start < end < start + n else n

    def trim(self, req: Request) -> None:
        """Return the blocks past the request's computed tokens (they held only rejected speculative
        tokens, so they were never full-and-computed, never hashed): tail first, evicted first."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-(req.num_computed_tokens - req.kv_evicted) // self.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(tail))

    def free(self, req: Request) -> None:
        """Return every block of the request. Tail blocks are freed first so they are evicted first."""
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        if self.slots is not None:
            self.slots.give_back(req.request_id)

    def state_slot(self, req: Request) -> int:
        """The linear-attention state slot ``req`` holds (hybrid models)."""
        return self.slots.slot(req.request_id)

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, ())]

    # -- accounting -------------------------------------------------------------
    def capacity(self, cap: int) -> int:
        """The longest sequence (at most ``cap`` tokens) the pool can hold alone."""
        return min(cap, self.num_blocks * self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        return self.pool.usage()


def _parent(req: Request, i: int) -> Optional[bytes]:
    return req.block_hashes[i - 1] if i > 0 else None
