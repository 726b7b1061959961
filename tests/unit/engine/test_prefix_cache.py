"""Block pool and prefix cache on a tiny pool: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from sidecar.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.request import Request, SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """What the scheduler does for a new request: look up the prefix, allocate, 'compute' it."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    r.num_cached_tokens = n
    return kv.block_ids(r)


def refs(kv: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in kv.pool.blocks[1:] if b.ref_cnt}


def test_free_queue_is_o1_lru():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.ids() == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert q.ids() == [1, 3, 4, 2]
    assert q.num_free == 4


def test_pool_reserves_block_zero_and_allocates_in_order():
    pool = BlockPool(6)
    assert pool.num_free_blocks() == 5
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    with pytest.raises(IndexError):
        pool.allocate(3)


def test_shared_prefix_reuses_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(10)))  # blocks: [0..3] [4..7] [8,9]
    assert admit(kv, a) == [1, 2, 3]
    b = req("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == [1, 2, 4]  # two full blocks shared, copy-free
    assert b.num_cached_tokens == 8
    assert refs(kv) == {1: 2, 2: 2, 3: 1, 4: 1}
    kv.free(a)
    kv.free(b)
    assert refs(kv) == {}
    assert kv.num_free_blocks() == 10


def test_partial_block_is_not_cached():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(6)))  # one full block + 2 tokens
    admit(kv, a)
    kv.free(a)
    b = req("b", list(range(6)))
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1] and n == 4  # the partial block is recomputed


def test_last_token_always_recomputed():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(8)))
    admit(kv, a)
    b = req("b", list(range(8)))  # identical, block-aligned prompt
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [h.block_id for h in hits] == [1]


def test_divergent_continuations_share_only_common_blocks():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    base = list(range(8))
    a = req("a", base + [100, 101, 102, 103, 104])
    b = req("b", base + [200, 201, 202, 203, 204])
    ids_a = admit(kv, a)
    ids_b = admit(kv, b)
    assert ids_a[:2] == ids_b[:2] == [1, 2]
    assert ids_a[2:] == [3, 4] and ids_b[2:] == [5, 6]
    assert refs(kv) == {1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1}


def test_freed_blocks_stay_cached_and_evict_tail_first_in_lru_order():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable blocks
    a = req("a", list(range(13)))  # blocks 1,2,3 full + 4 partial
    assert admit(kv, a) == [1, 2, 3, 4]
    kv.free(a)
    # Freed in reverse: 4, 3, 2, 1 join the tail behind never-used 5, 6.
    assert kv.pool.free_queue.ids() == [5, 6, 4, 3, 2, 1]
    assert set(kv.pool.cached) == {kv.pool.blocks[i].block_hash for i in (1, 2, 3)}
    # A new unrelated request of 12 tokens takes 5, 6, then evicts 4 (uncached) and 3 (tail of the chain).
    c = req("c", [900 + i for i in range(13)])
    assert admit(kv, c) == [5, 6, 4, 3]
    assert kv.pool.blocks[4].block_hash is not None  # c's third (full) block, keyed for c
    assert kv.pool.blocks[3].block_hash is None  # a's evicted tail block, now c's partial block
    d = req("d", list(range(13)))
    hits, n = kv.get_computed_blocks(d)
    assert [h.block_id for h in hits] == [1, 2] and n == 8  # head of a's chain survived


def test_eviction_under_pressure_then_allocation_fails_cleanly():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = req("a", list(range(12)))
    admit(kv, a)
    b = req("b", [500 + i for i in range(8)])
    hits, n = kv.get_computed_blocks(b)
    assert not kv.allocate_slots(b, 8, hits)  # needs 2, only 1 free: nothing changes
    assert refs(kv) == {1: 1, 2: 1, 3: 1}
    assert kv.block_ids(b) == []
    kv.free(a)
    assert kv.allocate_slots(b, 8)
    assert kv.block_ids(b) == [4, 3]  # never-used 4 first, then a's tail block 3


def test_hit_on_block_in_use_shares_it():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(9)))
    admit(kv, a)  # a keeps running
    b = req("b", list(range(9)))
    assert admit(kv, b)[:2] == [1, 2]
    assert kv.pool.blocks[1].ref_cnt == 2
    assert kv.block_ids(b) == [1, 2, 4]
    assert kv.pool.free_queue.ids() == [5, 6, 7, 8, 9, 10]


def test_hit_on_free_cached_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # free queue: 3, 2, 1 (1 and 2 cached)
    b = req("b", list(range(8)) + [70, 71, 72, 73, 74])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # b needs its 2 cached blocks + 2 new; reviving the cached ones leaves only 1 free.
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks() == 3 and refs(kv) == {}


def test_tenants_never_share_blocks():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(9)), salt="tenant-a")
    admit(kv, a)
    b = req("b", list(range(9)), salt="tenant-b")
    hits, n = kv.get_computed_blocks(b)
    assert hits == [] and n == 0
    c = req("c", list(range(9)), salt="tenant-a")
    hits, n = kv.get_computed_blocks(c)
    assert n == 8


def test_hit_verified_against_stored_tokens():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(9)))
    admit(kv, a)
    # Corrupt the stored tokens of block 1 as a hash collision would look: the hit must be refused.
    kv.pool.blocks[1].token_ids = (9, 9, 9, 9)
    b = req("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)


def test_prefix_stats_count_tokens():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    admit(kv, req("a", list(range(9))))
    admit(kv, req("b", list(range(9))))
    assert kv.prefix_queries == 18
    assert kv.prefix_hits == 8


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=11, block_size=BS, enable_caching=False)
    admit(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.pool.cached == {}


def test_a_duplicate_copy_takes_the_key_over_when_the_first_is_evicted():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    both = [(r, kv.get_computed_blocks(r)) for r in (a, b)]  # one step: both miss, both compute
    for r, (hits, n) in both:
        assert n == 0 and kv.allocate_slots(r, r.num_tokens, hits)
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    assert kv.block_ids(a) == [1, 2, 3] and kv.block_ids(b) == [4, 5, 6]
    assert {blk.block_id for blk in kv.pool.cached.values()} == {1, 2}
    assert {blk.block_id for d in kv.pool.duplicates.values() for blk in d} == {4, 5}
    kv.free(a)
    c = req("c", [900 + i for i in range(8)])  # takes a's blocks 3, 2: a's copy of the chain's tail goes
    assert admit(kv, c) == [3, 2]
    d = req("d", list(range(9)))
    hits, n = kv.get_computed_blocks(d)
    assert [blk.block_id for blk in hits] == [1, 5] and n == 8  # b's copy serves the second block
    kv.free(b)
    kv.free(c)
    kv.pool.allocate(1)  # block 1, a's first block: b's copy takes its key
    assert kv.pool.cached[d.block_hashes[0]].block_id == 4 and not kv.pool.duplicates
    assert kv.pool.consistent()


def test_reset_keeps_a_held_duplicate_registered():
    kv = KVCacheManager(num_blocks=7, block_size=BS)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    kv.free(a)  # the registered copies are free, the duplicates held
    kv.pool.reset_prefix_cache()
    assert {blk.block_id for blk in kv.pool.cached.values()} == {4, 5} and not kv.pool.duplicates
    assert all(kv.pool.blocks[i].block_hash is None for i in (1, 2, 3))
    assert kv.pool.consistent()
    kv.free(b)
    assert kv.num_free_blocks() == kv.num_blocks
