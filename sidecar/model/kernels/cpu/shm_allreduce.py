"""The all-reduce of the CPU ranks of one host through shared memory (``shm_allreduce.c``: layout, ordering and
waits there).

Rank 0 ``create``s the segment (a /dev/shm name), the other ranks ``attach`` to it by that name; once every
rank has mapped it, rank 0 ``unlink``s the name, so nothing is left behind however the processes end (the
mapping lives on in each rank until it unmaps or exits). A ``ShmAllReduce`` sums a contiguous float32 or bf16
CPU tensor over the ranks in place, every rank's result the same bits: the ranks' partials added in rank order
0..N-1 in float32 (bf16 rounded once at the end). A wait that times out, a peer that exits, or any rank's
``abort`` raises ``ShmAllReduceError`` on every rank, and the segment cannot be used again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import threading

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

log = logging.getLogger("sidecar.kernels")

_I64 = ctypes.c_int64
_STR = ctypes.c_char_p
_KERNEL = cpu_build.Kernel(
    "shm_allreduce",
    {
        "sidecar_shm_create": ([_STR, I, _I64], P),
        "sidecar_shm_attach": ([_STR, I, I], P),
        "sidecar_shm_unlink": ([_STR], I),
        "sidecar_shm_errno": ([], I),
        "sidecar_shm_abort": ([P], None),
        "sidecar_shm_close": ([P], None),
        "sidecar_shm_slot_bytes": ([P], _I64),
        "sidecar_shm_all_reduce": ([P, P, _I64, I, _I64, I], I),
    },
)
available = _KERNEL.available
# Bytes of one rank's slot: a longer tensor goes in chunks of this many bytes, one wait each. The segment is
# two buffers of a slot per rank.
SLOT_BYTES = 4 << 20
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {
    1: "timed out waiting for a peer rank",
    2: "a peer rank's process exited",
    3: "the group was aborted by a rank",
    4: "bad arguments",
    5: "ranks out of step (different element counts in one call)",
}


class ShmAllReduceError(RuntimeError):
    """A shared-memory all-reduce failed; the segment is aborted for every rank."""


def segment_name() -> str:
    """A fresh /dev/shm name for one group."""
    return f"/sidecar-tp-{os.getpid()}-{secrets.token_hex(6)}"


def segment_exists(name: str) -> bool:
    return os.path.exists("/dev/shm/" + name.lstrip("/"))


def unlink(name: str) -> None:
    """Remove the segment's name (idempotent: a name already gone is fine)."""
    lib = _KERNEL.lib()
    if lib is not None:
        lib.sidecar_shm_unlink(name.encode())


class ShmAllReduce:
    """One rank's mapping of the group's segment. ``timeout_s`` bounds each wait for the peers."""

    def __init__(self, handle: int, rank: int, world: int, timeout_s: float) -> None:
        self.handle, self.rank, self.world = handle, rank, world
        self.timeout_ms = int(timeout_s * 1000)
        self._lib = _KERNEL.lib()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(cls, name: str, world: int, timeout_s: float, slot_bytes: int = SLOT_BYTES) -> "ShmAllReduce":
        """Rank 0's segment ``name`` for ``world`` ranks; raises OSError naming the reason."""
        lib = _KERNEL.lib()
        if lib is None:
            raise OSError(f"shm_allreduce kernel not built: {cpu_build.reason('shm_allreduce')}")
        handle = lib.sidecar_shm_create(name.encode(), world, slot_bytes)
        if not handle:
            err = lib.sidecar_shm_errno()
            raise OSError(f"cannot create shared-memory segment {name}: {os.strerror(err)}")
        return cls(handle, 0, world, timeout_s)

    @classmethod
    def attach(cls, name: str, rank: int, world: int, timeout_s: float) -> "ShmAllReduce":
        """Rank ``rank``'s mapping of rank 0's segment ``name``; raises OSError naming the reason."""
        lib = _KERNEL.lib()
        if lib is None:
            raise OSError(f"shm_allreduce kernel not built: {cpu_build.reason('shm_allreduce')}")
        handle = lib.sidecar_shm_attach(name.encode(), rank, world)
        if not handle:
            err = lib.sidecar_shm_errno()
            raise OSError(
                f"rank {rank} cannot map shared-memory segment {name} "
                f"({os.strerror(err)}; a segment for {world} ranks expected)"
            )
        return cls(handle, rank, world, timeout_s)

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        """Whether ``t`` is a tensor this all-reduce sums (a contiguous float32 / bf16 CPU tensor)."""
        return t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (``supports(t)``) over the ranks in place; returns it. Raises ShmAllReduceError."""
        rc = self._lib.sidecar_shm_all_reduce(
            self.handle, t.data_ptr(), t.numel(), DTYPES[t.dtype], self.timeout_ms, torch.get_num_threads()
        )
        if rc:
            raise ShmAllReduceError(f"shared-memory all-reduce on rank {self.rank}: {_ERRORS.get(rc, rc)}")
        return t

    def abort(self) -> None:
        """End the group: every rank's present and later calls raise."""
        with self._lock:
            if not self._closed:
                self._lib.sidecar_shm_abort(self.handle)

    def close(self) -> None:
        """Unmap (idempotent). Only once no call can still be running on this rank."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._lib.sidecar_shm_close(self.handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown
            pass
