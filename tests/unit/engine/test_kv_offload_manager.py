"""KVCacheManager with offload tiers on a tiny pool: which blocks are offloaded when, which pool blocks a
load fills, and that a load never takes a block of the chain it continues (exact block ids)."""

from __future__ import annotations

import torch

from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.kv_offload import KVOffload
from sidecar.engine.request import Request, SamplingParams

BS = 4


class FakeDevice:
    """A pool's block contents: block id -> one byte tensor standing for its KV."""

    def __init__(self) -> None:
        self.data: dict[int, torch.Tensor] = {}
        self.writes: list[int] = []

    def read(self, block_id: int) -> torch.Tensor:
        return self.data[block_id].clone()

    def write(self, block_ids: list[int], datas: list[torch.Tensor]) -> None:
        for block_id, data in zip(block_ids, datas):
            self.writes.append(block_id)
            self.data[block_id] = data.clone()


def setup(num_blocks: int = 7):
    dev = FakeDevice()
    off = KVOffload(1 << 20, None, 0, "m", dev.read, dev.write)
    return KVCacheManager(num_blocks, BS, True, off), dev


def admit(kv: KVCacheManager, dev: FakeDevice, r: Request) -> list[int]:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    for i, b in enumerate(kv.block_ids(r)):  # 'compute': a block's content names its tokens
        if i >= n // BS:
            dev.data[b] = torch.tensor(r.all_token_ids[i * BS : (i + 1) * BS], dtype=torch.uint8)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    r.num_cached_tokens = n
    return kv.block_ids(r)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_evicted_blocks_are_offloaded_and_loaded_back_into_fresh_blocks():
    kv, dev = setup()
    doc = list(range(1, 14))  # 3 full blocks + 1 token
    a = req("a", doc)
    assert admit(kv, dev, a) == [1, 2, 3, 4]
    kv.free(a)
    b = req("b", list(range(50, 74)))  # needs all 6 blocks: evicts a's 3 cached blocks
    admit(kv, dev, b)
    s = kv.offload_stats()
    assert s["kv_offload_blocks"] == 3 and s["kv_offload_host_bytes_used"] == 3 * BS
    kv.free(b)
    c = req("c", doc)
    hits, n = kv.get_computed_blocks(c)
    assert n == 3 * BS and [h.ref_cnt for h in hits] == [0, 0, 0]  # loaded, cached, free until taken
    assert all(
        torch.equal(dev.data[h.block_id], torch.tensor(doc[i * BS : (i + 1) * BS], dtype=torch.uint8))
        for i, h in enumerate(hits)
    )
    assert kv.allocate_slots(c, c.num_tokens - n, hits)
    assert kv.offload_stats()["kv_offload_loaded_blocks"] == 3
    kv.free(c)
    assert kv.num_free_blocks() == kv.num_blocks


def test_a_load_never_takes_a_block_of_the_chain_it_continues():
    kv, dev = setup(num_blocks=5)  # 4 usable blocks
    doc = list(range(1, 14))
    a = req("a", doc)
    admit(kv, dev, a)  # blocks 1..4: three cached, the partial one not
    kv.free(a)  # free queue (evicted first): 4, 3, 2, 1
    x = req("x", list(range(60, 64)) + [1])  # takes block 4 (partial, uncached) and block 3: a's third block
    admit(kv, dev, x)
    assert (
        3 not in {b.block_id for b in kv.pool.cached.values()}
        and kv.offload_stats()["kv_offload_blocks"] == 1
    )
    kv.free(x)
    c = req("c", doc)
    hits, n = kv.get_computed_blocks(c)
    # Blocks 1 and 2 are pool hits; the third comes back from the host tier into a block that is neither.
    assert n == 3 * BS and [h.block_id for h in hits[:2]] == [1, 2] and hits[2].block_id not in (1, 2)
    assert dev.writes == [hits[2].block_id]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])


def test_without_free_blocks_a_load_stops_and_changes_nothing():
    kv, dev = setup(num_blocks=5)
    doc = list(range(1, 14))
    a = req("a", doc)
    admit(kv, dev, a)
    kv.free(a)
    holder = req("h", list(range(60, 76)))  # holds all 4 blocks (evicting a's)
    admit(kv, dev, holder)
    c = req("c", doc)
    hits, n = kv.get_computed_blocks(c)
    assert (hits, n) == ([], 0) and dev.writes == []
    kv.free(holder)
    assert kv.num_free_blocks() == kv.num_blocks


def test_block_copies_take_the_plain_path_on_cpu_and_the_disk_writer_waits_for_a_copy(tmp_path, monkeypatch):
    """On CPU the copier has no side stream and moves bytes like kv_quant; a buffer carrying a copy event
    (what a CUDA eviction returns) is waited on before the disk writer reads it."""
    from sidecar.engine import kv_copy
    from sidecar.engine.kv_disk import DiskTier
    from sidecar.model import kv_quant

    caches = [kv_quant.allocate(5, BS, 2, 8, torch.int8, torch.device("cpu")) for _ in range(2)]
    for layer in caches:
        for t in layer:
            t.copy_(torch.randint(-50, 50, t.shape).to(t.dtype))
    copier = kv_copy.BlockCopier(caches, torch.device("cpu"))
    assert copier.stream is None
    a, b = copier.read(1), copier.read(2)
    assert torch.equal(a, kv_quant.read_block(caches, 1))
    copier.write([3, 4], [b, a])
    assert torch.equal(copier.read(3), b) and torch.equal(copier.read(4), a)

    class Event:
        waited = 0

        def synchronize(self):
            Event.waited += 1

    data = torch.arange(40, dtype=torch.uint8)
    data.kv_copy_event = Event()
    tier = DiskTier(str(tmp_path), 1 << 20, "m")
    tier.put(b"\x02" * 32, (1, 2), data)
    tier.flush()
    assert Event.waited == 1 and torch.equal(tier._read(b"\x02" * 32, (1, 2)), data)
