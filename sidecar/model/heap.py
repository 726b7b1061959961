"""How the C heap keeps a CPU engine step's freed blocks.

Every step allocates the same large intermediates again: the logits of a decode batch (32 rows of a
151,936-token vocabulary in float32: 19 MiB a step), a prompt chunk's gate/up output (2,048 tokens of
Qwen2-0.5B: 20-40 MiB a layer). Under glibc's own mmap threshold (128 KiB at start, adjusted by glibc as mapped
blocks are freed) each is a fresh mapping, unmapped on free, so every step faults it in and zeroes it again
(what that cost: docs/perf/code-notes.md).

``keep_step_blocks()`` raises the mmap threshold to ``MMAP_THRESHOLD`` and the trim threshold to
``TRIM_THRESHOLD`` (``mallopt``), once, when a CPU engine has loaded: blocks under 64 MiB come from the heap and up
to 128 MiB freed at its top stays with the process for the next step. Larger blocks (weights, the KV pool) are
still mapped and unmapped on their own. A per-thread heap of glibc holds at most 64 MiB, so in the engine's thread
blocks near that size are still mapped.

Left alone where the user chose (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or these settings in
``GLIBC_TUNABLES``), with ``SIDECAR_KEEP_FREED=0``, off Linux, and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("sidecar.model")

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")

_state: dict[str, object] = {}


def _refusal(environ) -> str:
    """Why the thresholds are left as they are ('' when they may be set)."""
    if not sys.platform.startswith("linux"):
        return f"platform {sys.platform}"
    if environ.get("SIDECAR_KEEP_FREED", "1").strip().lower() in ("0", "false", "no", "off"):
        return "SIDECAR_KEEP_FREED=0"
    chosen = [name for name in USER_SETTINGS if name in environ]
    chosen += [name for name in USER_TUNABLES if name in environ.get("GLIBC_TUNABLES", "")]
    return f"set by the user ({', '.join(chosen)})" if chosen else ""


def keep_step_blocks(environ=None) -> dict[str, object]:
    """Set glibc's mmap and trim thresholds (once per process; later calls return the first call's result).
    Returns ``state`` (kept | off (why)) and, when kept, the two thresholds in bytes."""
    if _state:
        return dict(_state)
    why = _refusal(os.environ if environ is None else environ)
    if not why:
        try:
            libc = ctypes.CDLL(None)
            mallopt = libc.mallopt
            libc.gnu_get_libc_version  # glibc's own symbol: mallopt's numbers are glibc's
        except (OSError, AttributeError):
            why = "not glibc"
    if not why:
        done = (
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
        why = "" if done else "mallopt refused"
    _state.update(
        {"state": f"off ({why})"}
        if why
        else {"state": "kept", "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    )
    log.info(
        "freed step blocks: %s",
        _state["state"]
        if why
        else f"kept (heap up to {MMAP_THRESHOLD >> 20} MiB a block, {TRIM_THRESHOLD >> 20} MiB kept free)",
    )
    return dict(_state)
