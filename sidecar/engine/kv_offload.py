"""Second tier for prefix blocks: host RAM (LRU), then an optional disk directory.

A full block with a prefix hash that leaves the pool (its hash is dropped when the block is reused,
``BlockPool.on_evict``) is copied to the host tier and, when a directory is given, written to the disk
tier (write-through, so the disk holds every offloaded block until its own bound evicts it, and a restart
finds them; a writer thread does the writing, so an eviction on a request's path never waits for the disk,
and a block still queued is served from the queue). A later request whose chain of block hashes continues
past the pool's hits finds the next blocks here; ``KVCacheManager`` loads each into a fresh pool block
and registers it under its hash, so the scheduler counts those tokens as cached exactly like pool hits.

Entries are keyed by the chained block hash and verified against the block's token ids, as pool hits
are. The disk tier keeps one file per block under ``<dir>/<identity digest>/``, where the identity names
the model (checkpoint, architecture, a fingerprint of its weights), the KV dtype and the block layout, so
another model or dtype never reads it (the header repeats the digest). A file carries a CRC32 of its
payload; a corrupt, truncated or unreadable file is deleted, counted and reported as a miss (the block is
recomputed). A write that fails for want of space or permission (or a directory that cannot be made)
disables the disk tier with one log line; requests never fail because of a tier.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

import torch

from sidecar.engine.kv_disk import DiskTier

__all__ = ["DiskTier", "HostTier", "KVOffload", "model_identity", "offload_stats"]

log = logging.getLogger("sidecar.engine")


class HostTier:
    """Blocks kept in host memory, least recently used evicted first, bounded by bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: "OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor]]" = OrderedDict()

    def put(self, block_hash: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        if data.numel() > self.capacity:
            return
        old = self.entries.pop(block_hash, None)
        if old is not None:
            self.used -= old[1].numel()
        self.entries[block_hash] = (tokens, data)
        self.used += data.numel()
        while self.used > self.capacity:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.used -= dropped.numel()

    def get(self, block_hash: bytes, tokens: tuple[int, ...]) -> Optional[torch.Tensor]:
        entry = self.entries.get(block_hash)
        if entry is None or entry[0] != tokens:
            return None
        self.entries.move_to_end(block_hash)
        return entry[1]


class KVOffload:
    """The tiers behind a pool: ``offload`` copies an evicted block out, ``fetch`` + ``install`` bring one back.

    ``read_block(block_id)`` / ``write_blocks(block_ids, datas)`` move blocks' bytes between the device
    cache and the host (the runner's); a load writes a whole chain of blocks in one call."""

    def __init__(
        self,
        host_bytes: int,
        disk_dir: Optional[str],
        disk_bytes: int,
        identity: str,
        read_block: Callable[[int], torch.Tensor],
        write_blocks: Callable[[list[int], list[torch.Tensor]], None],
    ) -> None:
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, identity) if disk_dir else None
        self.read_block = read_block
        self.write_blocks = write_blocks
        self.counters = {
            "kv_offload_blocks": 0,
            "kv_offload_bytes": 0,
            "kv_offload_loaded_blocks": 0,
            "kv_offload_loaded_bytes": 0,
            "kv_offload_host_lookups": 0,
            "kv_offload_host_hits": 0,
            "kv_offload_disk_lookups": 0,
            "kv_offload_disk_hits": 0,
            "kv_offload_load_time_s": 0.0,
        }

    def offload(
        self, block_id: int, block_hash: bytes, tokens: tuple[int, ...], disk_only: bool = False
    ) -> None:
        """Copy a block whose hash is about to be dropped from the pool into the tiers (``disk_only``: a
        block that stays in the pool, written to the disk tier so that a restart finds its chain)."""
        to_disk = self.disk is not None and self.disk.enabled and block_hash not in self.disk.files
        to_host = self.host is not None and not disk_only
        if not to_host and not to_disk:
            return
        data = self.read_block(block_id)
        if to_host:
            self.host.put(block_hash, tokens, data)
        if to_disk:
            self.disk.put(block_hash, tokens, data)
        self.counters["kv_offload_blocks"] += 1
        self.counters["kv_offload_bytes"] += data.numel()

    def fetch(self, block_hash: bytes, tokens: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The offloaded bytes of the block with this hash and tokens (host tier first, then disk, which
        promotes a hit to the host tier), or None when no tier has it."""
        t = time.perf_counter()
        c = self.counters
        data = None
        if self.host is not None:
            c["kv_offload_host_lookups"] += 1
            data = self.host.get(block_hash, tokens)
            c["kv_offload_host_hits"] += data is not None
        if data is None and self.disk is not None and self.disk.enabled:
            c["kv_offload_disk_lookups"] += 1
            data = self.disk.get(block_hash, tokens)
            if data is not None:
                c["kv_offload_disk_hits"] += 1
                if self.host is not None:
                    self.host.put(block_hash, tokens, data)
        c["kv_offload_load_time_s"] += time.perf_counter() - t
        return data

    def install(self, block_ids: list[int], datas: list[torch.Tensor]) -> bool:
        """Write fetched bytes into pool blocks ``block_ids`` (one call for a chain); False (their contents
        undefined, so the caller must not register them) when they do not fit the pool's layout."""
        t = time.perf_counter()
        try:
            self.write_blocks(block_ids, datas)
        except (RuntimeError, ValueError) as exc:  # a block of another layout: recompute it instead
            log.warning("KV offload: cannot load %d block(s) (%s); recomputing them", len(block_ids), exc)
            return False
        c = self.counters
        c["kv_offload_loaded_blocks"] += len(block_ids)
        c["kv_offload_loaded_bytes"] += sum(d.numel() for d in datas)
        c["kv_offload_load_time_s"] += time.perf_counter() - t
        return True

    def stats(self) -> dict:
        """Cumulative counters, hit rates and the tiers' state (``offload_stats`` names every key)."""
        c = dict(self.counters)
        c["kv_offload_host_hit_rate"] = c["kv_offload_host_hits"] / max(1, c["kv_offload_host_lookups"])
        c["kv_offload_disk_hit_rate"] = c["kv_offload_disk_hits"] / max(1, c["kv_offload_disk_lookups"])
        c["kv_offload_host_bytes_used"] = self.host.used if self.host is not None else 0
        disk = self.disk
        c["kv_offload_disk_bytes_used"] = disk.used if disk is not None else 0
        c["kv_offload_disk_enabled"] = bool(disk is not None and disk.enabled)
        c["kv_offload_disk_corrupt"] = disk.corrupt if disk is not None else 0
        c["kv_offload_disk_errors"] = disk.errors if disk is not None else 0
        return c


def offload_stats(offload: Optional[KVOffload]) -> dict:
    """``offload.stats()``, or the same keys at zero without tiers (metrics and stats() always carry them)."""
    if offload is not None:
        return offload.stats()
    return KVOffload(0, None, 0, "", read_block=None, write_blocks=None).stats()


def model_identity(loaded, kv_dtype_name: str, block_size: int) -> str:
    """What a disk tier's blocks are valid for: checkpoint, every cached layer's shape (per-head K/V of each
    layer's own heads and size, or the latent form), dtypes, block layout and a fingerprint of the first
    megabyte of the first weight tensor (two checkpoints of one architecture differ there)."""
    a = loaded.args
    first = next(iter(loaded.model.parameters())).detach().reshape(-1)
    sample = first[: (1 << 20) // first.element_size()].contiguous().cpu()
    fingerprint = hashlib.sha256(sample.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
    return "|".join(
        str(x)
        for x in (
            loaded.model_dir,
            a.architecture,
            a.num_layers,
            a.kv_shapes(),
            getattr(a, "latent", None),
            a.vocab_size,
            loaded.dtype,
            loaded.quantization or "none",
            kv_dtype_name,
            block_size,
            fingerprint,
        )
    )
