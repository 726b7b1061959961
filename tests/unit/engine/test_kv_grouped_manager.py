"""GroupedKVCacheManager without a model: exact block ids of a full and a sliding group's tables, the blocks a
sliding group gives back as its window passes, a prefix hit after they were given back (the sliding group's
visible blocks only), and the pool whole after every sequence is freed."""

from __future__ import annotations

from sidecar.engine.kv_grouped import GroupedKVCacheManager
from sidecar.engine.kv_groups import GroupPlan, KVGroup
from sidecar.engine.request import Request, SamplingParams

PLAN = GroupPlan((KVGroup("full", None, (0,)), KVGroup("sliding", 8, (1,))), 1)
PROMPT = list(range(10, 30))  # 20 tokens: five blocks of 4


def _kv() -> GroupedKVCacheManager:
    return GroupedKVCacheManager(32, 4, True, PLAN, chunk=8)


def _step(kv: GroupedKVCacheManager, r: Request, n: int, hits=()) -> None:
    assert kv.allocate_slots(r, n, hits)
    r.num_computed_tokens += n + len(hits) * kv.block_size
    kv.cache_computed_blocks(r)


def _tables(kv, r):
    return [kv.block_ids(r, g) for g in range(len(PLAN.groups))]


def test_sliding_group_gives_back_passed_blocks_and_keeps_positions():
    kv = _kv()
    r = Request("a", list(PROMPT), SamplingParams(max_tokens=4))
    _step(kv, r, 20)
    assert _tables(kv, r) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    r.append_token(99)
    # the next query is at 20: the window sees 13..20, so blocks 0..2 (positions 0..11) are passed
    _step(kv, r, 1)
    assert _tables(kv, r) == [[1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12]]
    assert kv.held_blocks(r) == [6, 3] and kv.num_released_blocks == 3
    kv.free(r)
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


def test_prefix_hit_takes_the_full_chain_and_the_windows_visible_blocks():
    kv = _kv()
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=4))
    _step(kv, a, 20)
    a.append_token(99)
    _step(kv, a, 1)  # gives back sliding blocks 6, 7, 8 (still cached under their keys)
    kv.free(a)
    b = Request("b", list(PROMPT), SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(b)
    # four blocks (the last token is always recomputed); the query at 16 sees 9..16: sliding blocks 2, 3
    assert n == 16 and [x.block_id for x in hits] == [1, 2, 3, 4]
    assert [[x.block_id for x in h] for h in hits.per_group] == [[1, 2, 3, 4], [0, 0, 8, 9]]
    _step(kv, b, 4, hits)
    assert _tables(kv, b) == [[1, 2, 3, 4, 13], [0, 0, 8, 9, 14]]
    kv.free(b)
    assert kv.num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


def test_a_hit_without_the_windows_blocks_is_shortened():
    kv = _kv()
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=4))
    _step(kv, a, 20)
    kv.free(a)
    # drop the sliding group's block 3 (id 9) from the cache: a 4-block hit would need it
    del kv.pool.cached[kv.pool.blocks[9].block_hash]
    kv.pool.blocks[9].block_hash = None
    b = Request("b", list(PROMPT), SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(b)
    # three blocks: the query at 12 sees 5..12, sliding blocks 1 and 2 (ids 7, 8)
    assert n == 12 and [[x.block_id for x in h] for h in hits.per_group] == [[1, 2, 3], [0, 7, 8]]


def test_a_hit_in_one_group_is_never_handed_to_another():
    kv = GroupedKVCacheManager(11, 4, True, PLAN, chunk=8)
    a = Request("a", list(PROMPT), SamplingParams(max_tokens=4))
    _step(kv, a, 20)
    kv.free(a)
    rest = [b for b in kv.pool.blocks[1:] if b.block_id != 8]
    kv.pool.touch(rest)
    kv.pool.free(rest)  # block 8, a sliding-group hit below, now heads the free queue
    b = Request("b", list(PROMPT), SamplingParams(max_tokens=4))
    hits, n = kv.get_computed_blocks(b)
    assert [[x.block_id for x in h] for h in hits.per_group] == [[1, 2, 3, 4], [0, 0, 8, 9]]
    _step(kv, b, 4, hits)  # the full group's new block must not be the sliding group's hit
    assert _tables(kv, b) == [[1, 2, 3, 4, 5], [0, 0, 8, 9, 6]]
    kv.free(b)
    assert kv.num_free_blocks() == kv.num_blocks
