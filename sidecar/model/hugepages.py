"""Transparent huge pages for the weights and the KV cache, without restarting the process.

A decode step reads every weight once; in 2 MiB pages instead of 4 KiB ones the TLB stops missing every
few kilobytes. The ``sidecar`` command gets that from glibc (it restarts itself with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``); a Python program that constructs ``LLM`` gets it here:

1. ``enable_torch_allocator()`` asks torch's CPU allocator for 2 MiB-aligned, ``MADV_HUGEPAGE``-advised
   blocks of 2 MiB and more (``THP_MEM_ALLOC_ENABLE=1``). torch reads the variable at its first CPU
   allocation, so it takes effect when ``sidecar.LLM`` is looked up before the program allocates tensors.
2. Otherwise (or for memory allocated elsewhere), ``advise_new(snapshot())`` advises the anonymous memory
   the engine mapped since the snapshot (``MADV_HUGEPAGE``: later faults there take huge pages) and
   collapses what is already resident into huge pages (``MADV_COLLAPSE``, Linux 6.1+). Regions mostly not
   resident yet (a lazily committed KV pool) are advised but not collapsed, so no memory is committed here.

Nothing happens where transparent huge pages are off (``never``), off Linux, or with
``SIDECAR_HUGE_PAGES=0``.

``release(start, nbytes)`` gives memory nothing reads again back to the kernel (the loader's plain weights as their
tiled copies are made: ``bf16_gemv.tile_weight``), whatever the huge-page setting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Optional

log = logging.getLogger("sidecar.model")

ALLOCATOR_ENV = "THP_MEM_ALLOC_ENABLE"
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20
PAGE = 4096
RESIDENT_TO_COLLAPSE = 0.75  # collapse a region when at least this share of it is resident already
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(
        "SIDECAR_HUGE_PAGES", "1"
    ).strip().lower() not in ("0", "false", "no", "off")


def thp_mode(path: str = _THP_SETTING) -> str:
    """The kernel's transparent-huge-page mode: always | madvise | never ('' where unknown)."""
    try:
        text = open(path).read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def enable_torch_allocator() -> bool:
    """Ask torch's CPU allocator for huge pages (before its first allocation); False where not wanted or
    where the variable is already set (the user's choice is kept)."""
    if not wanted() or ALLOCATOR_ENV in os.environ or thp_mode() in ("", "never"):
        return False
    os.environ[ALLOCATOR_ENV] = "1"
    return True


def anon_regions(smaps: str = "/proc/self/smaps") -> dict[tuple[int, int], dict[str, int]]:
    """Writable private anonymous mappings (the heap included): (start, end) -> {Rss, AnonHugePages} bytes,
    ``advised`` 1 where the mapping carries MADV_HUGEPAGE."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    current: Optional[dict[str, int]] = None
    try:
        lines = open(smaps).read().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            current = None
            perms, inode = head[1], head[4] if len(head) > 4 else "0"
            path = head[5] if len(head) > 5 else ""
            if perms.startswith("rw") and perms.endswith("p") and inode == "0" and path in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = out.setdefault((lo, hi), {"Rss": 0, "AnonHugePages": 0, "advised": 0})
        elif current is not None and head and head[0] in ("Rss:", "AnonHugePages:"):
            current[head[0][:-1]] = int(head[1]) * 1024
        elif current is not None and head and head[0] == "VmFlags:":
            current["advised"] = int("hg" in head[1:])
    return out


def snapshot() -> set[tuple[int, int]]:
    """The anonymous mappings that exist now (those ``advise_new`` leaves alone)."""
    return set(anon_regions()) if wanted() else set()


def _madvise(libc, start: int, length: int, advice: int) -> int:
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


def release(start: int, nbytes: int) -> int:
    """Give the whole pages inside ``[start, start + nbytes)`` back to the kernel (``MADV_DONTNEED``; not a huge-page
    matter, so not subject to ``wanted()``): pages of a file mapping leave this process's resident set, anonymous ones
    are freed and read as zeros after. For memory nothing reads again. Returns 0 or the errno (0 off Linux)."""
    first, end = -(-start // PAGE) * PAGE, (start + nbytes) // PAGE * PAGE
    if end <= first or not sys.platform.startswith("linux"):
        return 0
    return _madvise(ctypes.CDLL(None, use_errno=True), first, end - first, MADV_DONTNEED)


def advise_new(before: set[tuple[int, int]]) -> dict[str, object]:
    """Advise (and where resident, collapse) the anonymous mappings of 2 MiB and more that are not in
    ``before``. Returns what was done: ``state`` (off | advised | collapsed), regions, bytes in huge pages."""
    mode = thp_mode()
    if not wanted() or mode in ("", "never"):
        why = "SIDECAR_HUGE_PAGES=0" if not wanted() else f"transparent huge pages: {mode or None}"
        return {"state": f"off ({why})"}
    libc = ctypes.CDLL(None, use_errno=True)
    t = time.perf_counter()
    advised = collapsed = 0
    collapse_ok = True
    refused: dict[str, int] = {}  # MADV_COLLAPSE is best effort: no free huge page now is EAGAIN / ENOMEM
    for (lo, hi), info in anon_regions().items():
        if (lo, hi) in before or hi - lo < HUGE:
            continue
        if _madvise(libc, lo, hi - lo, MADV_HUGEPAGE) == 0:
            advised += 1
        if (
            collapse_ok
            and info["Rss"] - info["AnonHugePages"] >= HUGE
            and info["Rss"] >= RESIDENT_TO_COLLAPSE * (hi - lo)
        ):
            err = _madvise(libc, lo, hi - lo, MADV_COLLAPSE)
            collapse_ok = err != 22  # EINVAL: a kernel without MADV_COLLAPSE; khugepaged collapses later
            collapsed += err == 0
            if err:
                refused[os.strerror(err)] = refused.get(os.strerror(err), 0) + 1
    huge = sum(v["AnonHugePages"] for k, v in anon_regions().items() if k not in before)
    state = "collapsed" if collapsed else "advised"
    log.info(
        "huge pages: %d new regions advised, %d collapsed%s, %.0f MiB in huge pages (%.2f s)",
        advised,
        collapsed,
        f" (refused: {refused})" if refused else "",
        huge / 2**20,
        time.perf_counter() - t,
    )
    return {
        "state": state,
        "advised": advised,
        "collapsed": collapsed,
        "collapse_refused": refused,
        "huge_bytes": huge,
    }
