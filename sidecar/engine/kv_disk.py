"""The disk tier of the KV offload (``kv_offload.py``): one checksummed file per block under
``<dir>/<identity digest>/``, written by a writer thread and bounded by bytes (LRU by use)."""

from __future__ import annotations

import atexit
import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from sidecar.engine.kv_copy import ready

log = logging.getLogger("sidecar.engine")

MAGIC = b"SKV1"
_HEADER = struct.Struct("<4s32s32sIQI")  # magic, identity digest, block hash, n tokens, payload bytes, crc32
_SUFFIX = ".kvb"
_LIVE: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()  # tiers whose writer may hold queued blocks


@atexit.register
def _flush_all() -> None:
    """Queued blocks reach the disk before the process exits (a restart finds them)."""
    for tier in list(_LIVE):
        tier.flush()


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
        for other in list(_LIVE):  # an earlier engine on this directory: its queued blocks first
            if other.dir == self.dir:
                other.flush()
        _LIVE.add(self)
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
        ready(data)  # on CUDA: the side-stream copy that fills these bytes is done
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
        if (
            magic != MAGIC
            or digest != self.digest
            or stored_hash != block_hash
            or n != len(tokens)
            or len(raw) != start + nbytes
        ):
            return None
        if struct.unpack_from(f"<{n}q", raw, _HEADER.size) != tuple(tokens):
            return None
        payload = raw[start:]
        if zlib.crc32(payload) != crc:
            return None
        return torch.frombuffer(payload, dtype=torch.uint8)  # the read buffer itself, no copy
