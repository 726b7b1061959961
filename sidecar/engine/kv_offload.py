"""Second tier for prefix blocks: host RAM (LRU), then an optional disk directory.

A full block with a prefix hash that leaves the pool (its hash is dropped when the block is reused,
``BlockPool.on_evict``) is copied to the host tier and, when a directory is given, written to the disk
tier (write-through, so the disk holds every offloaded block until its own bound evicts it, and a restart
finds them; a writer thread does the writing, so an eviction on a request's path never waits for the disk,
and a block still queued is served from the queue). A later request whose chain of block hashes continues past the pool's hits finds the next
blocks here; ``KVCacheManager`` loads each into a fresh pool block and registers it under its hash, so
the scheduler counts those tokens as cached exactly like pool hits.

Entries are keyed by the chained block hash and verified against the block's token ids, as pool hits
are. The disk tier keeps one file per block under ``<dir>/<identity digest>/``, where the identity names
the model (checkpoint, architecture, a fingerprint of its weights), the KV dtype and the block layout, so
another model or dtype never reads it (the header repeats the digest). A file carries a CRC32 of its
payload; a corrupt, truncated or unreadable file is deleted, counted and reported as a miss (the block is
recomputed). A write that fails for want of space or permission (or a directory that cannot be made)
disables the disk tier with one log line; requests never fail because of a tier.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger("sidecar.engine")

MAGIC = b"SKV1"
_HEADER = struct.Struct("<4s32s32sIQI")  # magic, identity digest, block hash, n tokens, payload bytes, crc32
_SUFFIX = ".kvb"


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


class DiskTier:
    """One checksummed file per block in ``root/<identity digest>/``, bounded by bytes (LRU by use)."""

    def __init__(self, root: str, capacity_bytes: int, identity: str) -> None:
        self.capacity = capacity_bytes
        self.digest = hashlib.sha256(identity.encode()).digest()
        self.dir = Path(root) / self.digest.hex()[:32]
        self.enabled = True
        self.corrupt = 0  # files dropped because they failed a check
        self.errors = 0  # writes or reads that failed for another reason
        self.used = 0
        self.files: "OrderedDict[bytes, int]" = OrderedDict()  # block hash -> file size, oldest use first
        # Blocks queued for the writer thread (served from here until written); the lock guards files, used
        # and pending, which the writer updates too.
        self.pending: dict[bytes, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._lock = threading.RLock()
        self._queue: "queue.Queue[bytes]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            found = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime)
        except OSError as exc:
            self._disable(exc)
            return
        for path in found:
            try:
                self.files[bytes.fromhex(path.stem)] = size = path.stat().st_size
                self.used += size
            except (OSError, ValueError):
                continue
        self._shrink()

    def _disable(self, exc: OSError) -> None:
        self.enabled = False
        log.warning("KV offload disk tier off (%s): %s", self.dir, exc)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + _SUFFIX)

    def _drop(self, block_hash: bytes) -> None:
        with self._lock:
            self.used -= self.files.pop(block_hash, 0)
            self.pending.pop(block_hash, None)
        try:
            self._path(block_hash).unlink()
        except OSError:
            pass

    def _shrink(self) -> None:
        while self.used > self.capacity and self.files:
            self._drop(next(iter(self.files)))

    def put(self, block_hash: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        """Queue the block for the writer thread (an eviction never waits for the disk); until written, a
        ``get`` serves it from the queue."""
        size = _HEADER.size + 8 * len(tokens) + data.numel()
        if not self.enabled or block_hash in self.files or size > self.capacity:
            return
        with self._lock:
            self.files[block_hash] = size
            self.used += size
            self.pending[block_hash] = (tokens, data)
            self._shrink()
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-offload-disk", daemon=True)
            self._writer.start()
        self._queue.put(block_hash)

    def flush(self) -> None:
        """Wait until every queued block is on disk (or dropped)."""
        if self._writer is not None:
            self._queue.join()

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                with self._lock:
                    entry = self.pending.get(block_hash)
                if entry is not None and self.enabled:
                    self._write(block_hash, *entry)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        payload = data.numpy().data
        toks = struct.pack(f"<{len(tokens)}q", *tokens)
        head = _HEADER.pack(MAGIC, self.digest, block_hash, len(tokens), len(payload), zlib.crc32(payload))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(head)
                fh.write(toks)
                fh.write(payload)
            os.replace(tmp, path)  # readers see a whole file or none
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            with self._lock:
                self.pending.pop(block_hash, None)
                self.used -= self.files.pop(block_hash, 0)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                    if self.enabled:
                        self._disable(exc)
                else:
                    self.errors += 1
            return
        with self._lock:
            self.pending.pop(block_hash, None)
            gone = block_hash not in self.files  # dropped by the bound while it was being written
        if gone:
            try:
                path.unlink()
            except OSError:
                pass

    def get(self, block_hash: bytes, tokens: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The block's bytes, or None: absent, another block's tokens, or a file that fails a check (then
        deleted and counted)."""
        if not self.enabled or block_hash not in self.files:
            return None
        with self._lock:
            entry = self.pending.get(block_hash)
            if entry is not None:
                self.files.move_to_end(block_hash)
                return entry[1] if entry[0] == tokens else None
        data = self._read(block_hash, tokens)
        if data is None:
            return None
        with self._lock:
            if block_hash in self.files:
                self.files.move_to_end(block_hash)
        return data

    def _read(self, block_hash: bytes, tokens: tuple[int, ...]) -> Optional[torch.Tensor]:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as fh:
                raw = bytearray(os.fstat(fh.fileno()).st_size)
                n = fh.readinto(raw)
        except OSError:
            self.errors += 1
            self._drop(block_hash)
            return None
        data = self._parse(memoryview(raw)[:n], block_hash, tokens)
        if data is None:
            self.corrupt += 1
            log.warning("KV offload: dropped a damaged block file %s", path.name)
            self._drop(block_hash)
        return data

    def _parse(self, raw: memoryview, block_hash: bytes, tokens: tuple[int, ...]) -> Optional[torch.Tensor]:
        if len(raw) < _HEADER.size:
            return None
        magic, digest, stored_hash, n, nbytes, crc = _HEADER.unpack_from(raw)
        start = _HEADER.size + 8 * n
        if (magic != MAGIC or digest != self.digest or stored_hash != block_hash or n != len(tokens)
                or len(raw) != start + nbytes):
            return None
        if struct.unpack_from(f"<{n}q", raw, _HEADER.size) != tuple(tokens):
            return None
        payload = raw[start:]
        if zlib.crc32(payload) != crc:
            return None
        return torch.frombuffer(payload, dtype=torch.uint8)  # the read buffer itself, no copy


class KVOffload:
    """The tiers behind a pool: ``offload`` copies an evicted block out, ``fetch`` + ``install`` bring one back.

    ``read_block(block_id)`` / ``write_blocks(block_ids, datas)`` move blocks' bytes between the device
    cache and the host (the runner's); a load writes a whole chain of blocks in one call."""

    def __init__(self, host_bytes: int, disk_dir: Optional[str], disk_bytes: int, identity: str,
                 read_block: Callable[[int], torch.Tensor],
                 write_blocks: Callable[[list[int], list[torch.Tensor]], None]) -> None:
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, identity) if disk_dir else None
        self.read_block = read_block
        self.write_blocks = write_blocks
        self.counters = {"kv_offload_blocks": 0, "kv_offload_bytes": 0, "kv_offload_loaded_blocks": 0,
                         "kv_offload_loaded_bytes": 0, "kv_offload_host_lookups": 0, "kv_offload_host_hits": 0,
                         "kv_offload_disk_lookups": 0, "kv_offload_disk_hits": 0, "kv_offload_load_time_s": 0.0}

    def offload(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        """Copy a block whose hash is about to be dropped from the pool into the tiers."""
        to_disk = self.disk is not None and self.disk.enabled and block_hash not in self.disk.files
        if self.host is None and not to_disk:
            return
        data = self.read_block(block_id)
        if self.host is not None:
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
    """What a disk tier's blocks are valid for: checkpoint, shapes, dtypes, block layout and a fingerprint
    of the first megabyte of the first weight tensor (two checkpoints of one architecture differ there)."""
    a = loaded.args
    first = next(iter(loaded.model.parameters())).detach().reshape(-1)
    sample = first[: (1 << 20) // first.element_size()].contiguous().cpu()
    fingerprint = hashlib.sha256(sample.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
    return "|".join(str(x) for x in (
        loaded.model_dir, a.architecture, a.num_layers, a.num_kv_heads, a.head_dim, a.vocab_size, loaded.dtype,
        loaded.quantization or "none", kv_dtype_name, block_size, fingerprint))
