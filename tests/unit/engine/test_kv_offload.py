"""Offload tiers for evicted prefix blocks: a prompt whose prefix left the pool is served from the host tier,
the disk tier and after a restart with exactly the first run's tokens; damaged files, another model's tier,
a disk that cannot be written; pool and tiers whole after aborts and preemptions around loads."""

from __future__ import annotations

import errno
import logging
import random
import threading
from pathlib import Path

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine import kv_disk
from sidecar.engine.block_pool import hash_block
from sidecar.engine.kv_offload import DiskTier

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BS = 8
rng = random.Random(3)
DOC = [rng.randrange(3, 900) for _ in range(100)]  # 12 full blocks of 8 + 4 tokens
FILLERS = [[rng.randrange(3, 900) for _ in range(170)] for _ in range(2)]  # each fills the pool's 23 blocks


def make(demo_dir, **kw) -> LLM:
    kw = {"num_kv_blocks": 24, **kw}
    return LLM(model=str(demo_dir), dtype="float32", block_size=BS, **kw)


def doc_hashes(prompt=DOC) -> list[bytes]:
    out, parent = [], None
    for i in range(len(prompt) // BS):
        parent = hash_block(parent, tuple(prompt[i * BS : (i + 1) * BS]), None)
        out.append(parent)
    return out


def evict_doc(llm: LLM) -> None:
    for f in FILLERS:
        llm.generate([f], GREEDY)
    assert all(h not in llm.engine.kv.pool.cached for h in doc_hashes())  # every doc block left the pool


def pool_whole(llm: LLM) -> bool:
    eng = llm.engine
    return (
        not eng.requests
        and not eng.kv.req_blocks
        and eng.kv.num_free_blocks() == eng.kv.num_blocks
        and all(b.ref_cnt == 0 for b in eng.kv.pool.blocks[1:])
    )


def host_whole(llm: LLM) -> bool:
    host = llm.engine.kv.offload.host
    return host.used == sum(d.numel() for _, d in host.entries.values()) <= host.capacity


@pytest.fixture(scope="module")
def reference(demo_dir) -> list[int]:
    """The doc's tokens from an engine without tiers (and without prefix caching)."""
    return make(demo_dir, enable_prefix_caching=False).generate([DOC], GREEDY)[0].token_ids


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_host_tier_serves_an_evicted_prefix_with_the_same_tokens(demo_dir, kv_dtype):
    llm = make(demo_dir, kv_offload_gb=0.01, kv_cache_dtype=kv_dtype)
    first = llm.generate([DOC], GREEDY)[0]
    evict_doc(llm)
    again = llm.generate([DOC], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 12 * BS
    s = llm.stats()
    assert s["kv_offload_loaded_blocks"] == 12 and s["kv_offload_host_hits"] == 12
    assert s["kv_offload_loaded_bytes"] == 12 * llm.engine.runner.read_block(1).numel()
    assert s["prefix_cache_hits"] >= 12 * BS
    assert pool_whole(llm) and host_whole(llm)


def test_disk_tier_then_restart_then_another_model(demo_dir, reference, tmp_path):
    llm = make(demo_dir, kv_offload_dir=str(tmp_path))  # no host tier: the disk tier alone
    assert llm.generate([DOC], GREEDY)[0].token_ids == reference
    evict_doc(llm)
    again = llm.generate([DOC], GREEDY)[0]
    assert again.token_ids == reference and again.num_cached_tokens == 12 * BS
    assert llm.stats()["kv_offload_disk_hits"] == 12
    llm.engine.kv.offload.disk.flush()
    del llm

    restarted = make(demo_dir, kv_offload_dir=str(tmp_path), kv_offload_gb=0.01)
    out = restarted.generate([DOC], GREEDY)[0]
    assert out.token_ids == reference and out.num_cached_tokens == 12 * BS
    assert restarted.stats()["kv_offload_disk_hits"] == 12

    for other in (dict(kv_cache_dtype="int8"), dict(num_kv_blocks=30, block_size=16)):
        kw = {"kv_offload_dir": str(tmp_path), **other}
        llm = LLM(model=str(demo_dir), dtype="float32", **{"block_size": BS, **kw})
        out = llm.generate([DOC], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.stats()["kv_offload_disk_hits"] == 0
    assert len(list(Path(tmp_path).iterdir())) == 3  # one directory per model identity


def test_a_chain_whose_head_stayed_in_the_pool_is_whole_on_disk_after_a_restart(
    demo_dir, reference, tmp_path
):
    """The pool evicts a chain's tail first, so a document's first blocks may never leave it; the disk tier
    still gets them (when the first of their chain is evicted), so a restart can walk the chain from its root."""
    llm = make(demo_dir, kv_offload_dir=str(tmp_path))
    llm.generate([DOC], GREEDY)
    llm.generate([FILLERS[0][:150]], GREEDY)  # takes the never-used blocks, then the doc's tail
    in_pool = [h in llm.engine.kv.pool.cached for h in doc_hashes()]
    assert in_pool[0] and not all(in_pool)  # the head stayed, the tail left
    disk = llm.engine.kv.offload.disk
    disk.flush()
    assert all(h in disk.files for h in doc_hashes())  # the head written too, though never evicted
    del llm
    restarted = make(demo_dir, kv_offload_dir=str(tmp_path))
    out = restarted.generate([DOC], GREEDY)[0]
    assert out.token_ids == reference and out.num_cached_tokens == 12 * BS
    assert restarted.stats()["kv_offload_disk_hits"] == 12


def test_damaged_files_are_dropped_counted_and_recomputed(demo_dir, reference, tmp_path, caplog):
    llm = make(demo_dir, kv_offload_dir=str(tmp_path))
    llm.generate([DOC], GREEDY)
    evict_doc(llm)
    llm.engine.kv.offload.disk.flush()
    (sub,) = Path(tmp_path).iterdir()
    hashes = doc_hashes()
    corrupt, truncated = sub / (hashes[5].hex() + ".kvb"), sub / (hashes[9].hex() + ".kvb")
    raw = bytearray(corrupt.read_bytes())
    raw[-10] ^= 0xFF  # a flipped payload byte: the checksum fails
    corrupt.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    del llm

    llm = make(demo_dir, kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        out = llm.generate([DOC], GREEDY)[0]
    assert out.token_ids == reference and out.finish_reason == "length"
    assert out.num_cached_tokens == 5 * BS  # blocks 0-4 loaded; block 5 failed its check and was recomputed
    s = llm.stats()
    assert s["kv_offload_disk_corrupt"] == 1 and not corrupt.exists()
    assert "damaged" in caplog.text
    # The chain was recomputed past the damaged block, so its later blocks (the truncated one among them)
    # are never read; a fresh engine that asks for block 9 directly drops it too.
    tier = DiskTier(
        str(tmp_path), 1 << 30, llm.engine.kv.offload.disk.digest.hex()
    )  # a wrong identity: reads nothing
    assert tier.get(hashes[9], tuple(DOC[72:80])) is None
    disk = llm.engine.kv.offload.disk
    assert disk.get(hashes[9], tuple(DOC[72:80])) is None and not truncated.exists()
    assert llm.stats()["kv_offload_disk_corrupt"] == 2
    assert pool_whole(llm)


def test_a_file_of_another_identity_is_never_served(tmp_path):
    a = DiskTier(str(tmp_path), 1 << 20, "model-a")
    b = DiskTier(str(tmp_path), 1 << 20, "model-b")
    data = torch.arange(64, dtype=torch.uint8)
    h, toks = b"\x01" * 32, (5, 6, 7)
    a.put(h, toks, data)
    assert torch.equal(a.get(h, toks), data)  # served from the writer's queue or from the file
    a.flush()
    assert torch.equal(a.get(h, toks), data)  # from the file
    assert b.get(h, toks) is None  # another model's directory holds nothing
    # Even a file copied into b's directory is refused (the header names a's identity) and dropped.
    (b.dir / (h.hex() + ".kvb")).write_bytes((a.dir / (h.hex() + ".kvb")).read_bytes())
    b2 = DiskTier(str(tmp_path), 1 << 20, "model-b")
    assert b2.get(h, toks) is None and b2.corrupt == 1 and not (b2.dir / (h.hex() + ".kvb")).exists()
    # A file whose stored tokens are not the ones its hash was asked for is inconsistent: dropped too.
    assert a.get(h, (5, 6, 8)) is None and a.corrupt == 1 and a.get(h, toks) is None


def test_disk_bound_evicts_least_recently_used_files(tmp_path):
    tier = DiskTier(str(tmp_path), 3 * 200, "m")
    data = torch.zeros(100, dtype=torch.uint8)
    keys = [bytes([i]) * 32 for i in range(4)]
    for k in keys[:3]:
        tier.put(k, (1,), data)
    tier.get(keys[0], (1,))  # used: now the most recent
    tier.put(keys[3], (1,), data)
    assert set(tier.files) == {keys[0], keys[2], keys[3]} and tier.used <= 600
    tier.flush()
    assert len(list(tier.dir.glob("*.kvb"))) == 3


def test_a_full_disk_disables_the_tier_with_one_log_line(demo_dir, reference, tmp_path, monkeypatch, caplog):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    llm = make(demo_dir, kv_offload_dir=str(tmp_path), kv_offload_gb=0.01)
    monkeypatch.setattr(kv_disk, "open", full, raising=False)
    with caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        llm.generate([DOC], GREEDY)
        evict_doc(llm)
        out = llm.generate([DOC], GREEDY)[0]
        llm.engine.kv.offload.disk.flush()
    assert out.token_ids == reference and out.num_cached_tokens == 12 * BS  # the host tier still serves
    assert caplog.text.count("disk tier off") == 1
    assert llm.stats()["kv_offload_disk_enabled"] is False


def test_a_directory_that_cannot_be_made_disables_the_tier(demo_dir, reference, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="sidecar.engine"):
        llm = make(demo_dir, kv_offload_dir=str(blocker / "tier"))
    assert caplog.text.count("disk tier off") == 1
    assert llm.generate([DOC], GREEDY)[0].token_ids == reference
    assert llm.stats()["kv_offload_disk_enabled"] is False


def test_abort_right_after_a_load_and_preemption_around_loads_keep_pool_and_tiers_whole(demo_dir, reference):
    llm = make(demo_dir, kv_offload_gb=0.01, max_num_batched_tokens=16)
    eng = llm.engine
    llm.generate([DOC], GREEDY)
    evict_doc(llm)
    rid = eng.add_request(None, DOC, GREEDY)
    eng.step()  # the doc's blocks are loaded into the pool and its last chunk runs
    assert eng.stats()["kv_offload_loaded_blocks"] == 12
    eng.abort(rid)
    eng.step()
    assert pool_whole(llm) and host_whole(llm)

    # Requests sharing the doc's offloaded prefix with others that need the pool: preemptions happen while
    # loaded blocks are held; every output equals its tier-less reference.
    evict_doc(llm)
    suffixes = [[rng.randrange(3, 900) for _ in range(n)] for n in (3, 9, 20)]
    prompts = [DOC + s for s in suffixes] + [f[:60] for f in FILLERS]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    base = make(demo_dir, enable_prefix_caching=False, num_kv_blocks=64)
    want = [o.token_ids for o in base.generate(prompts, params)]
    before = eng.stats()["kv_offload_loaded_blocks"]
    outs = llm.generate(prompts, params)
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["kv_offload_loaded_blocks"] > before
    assert [o.token_ids for o in outs] == want
    assert pool_whole(llm) and host_whole(llm)
    assert llm.generate([DOC], GREEDY)[0].token_ids == reference


def test_metrics_and_model_info_carry_the_pool_and_the_tiers(demo_dir, tmp_path):
    from sidecar.server.metrics import Metrics

    llm = make(demo_dir, kv_offload_gb=0.01, kv_cache_dtype="int8")
    llm.generate([DOC], GREEDY)
    evict_doc(llm)
    llm.generate([DOC], GREEDY)
    stats = llm.stats()
    body = Metrics(llm.stats).render()[0].decode()
    assert f"sidecar_kv_cache_tokens {float(stats['kv_cache_tokens'])}" in body
    assert stats["kv_cache_tokens"] == 23 * BS == llm.engine.model_info["kv_cache_tokens"]
    assert "sidecar_kv_offload_loaded_blocks_total 12.0" in body
    assert "sidecar_kv_offload_host_hits_total 12.0" in body
    assert llm.engine.model_info["kv_cache_dtype"] == "int8"


def test_a_new_tier_on_the_directory_waits_for_the_blocks_an_earlier_one_still_has_queued(
    tmp_path, monkeypatch
):
    slow = threading.Event()
    a = DiskTier(str(tmp_path), 1 << 20, "m")
    real = a._write

    def delayed(*args):
        slow.wait(5)
        real(*args)

    monkeypatch.setattr(a, "_write", delayed)
    data, h, toks = torch.arange(50, dtype=torch.uint8), b"\x03" * 32, (4, 5)
    a.put(h, toks, data)
    threading.Timer(0.2, slow.set).start()  # the write completes only a moment later
    b = DiskTier(str(tmp_path), 1 << 20, "m")  # a restart in the same process: sees the file
    assert h in b.files and torch.equal(b.get(h, toks), data)


def test_the_identity_covers_every_cached_layer_shape():
    """Two models alike in layer 0 but not in a later layer's KV heads or head size never share a disk tier."""
    import dataclasses
    from types import SimpleNamespace

    from sidecar.engine.kv_offload import model_identity
    from sidecar.model.args import ModelArgs

    args = ModelArgs.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    model = torch.nn.Linear(2, 2)

    def identity(a) -> str:
        loaded = SimpleNamespace(args=a, model=model, model_dir="m", dtype=torch.float32, quantization=None)
        return model_identity(loaded, "float32", 8)

    wide = dataclasses.replace(args, layer_head_dims=(16, 32), layer_kv_heads=(2, 1))
    assert identity(args) != identity(wide)
    assert identity(wide) != identity(dataclasses.replace(wide, layer_kv_heads=(2, 2)))
    assert identity(args) == identity(dataclasses.replace(args))
