"""Where the threads of a tensor / pipeline parallel rank run on a CPU host.

Ranks of one host split its CPUs (those this process may use, ``os.sched_getaffinity``) into disjoint sets,
one per rank, and each rank's threads (torch's intra-op pool, the C kernels' OpenMP team, every other thread
of the process) are pinned to its set, with as many compute threads as the set has CPUs: ranks then do not
compete for cores, and on a host of several NUMA nodes each rank reads its weights and KV from its own node's
memory (first touch by the pinned threads), as vLLM's CPU backend advises for multi-socket hosts.

``SIDECAR_CPU_BIND`` chooses:
- ``auto`` (the default): whole NUMA nodes per rank where the nodes (those holding allowed CPUs) divide evenly
  between the ranks, as many CPUs in each; otherwise the allowed CPUs in order, in equal contiguous runs. A host with
  fewer CPUs than ranks is not pinned (logged).
- ``off``: no pinning; each rank takes ``num_threads`` or CPUs / ranks threads, as before.
- explicit sets, one per rank of the host, ``|``-separated, in Linux cpulist form: ``0-15|16-31``.

Rank 0 is the serving process itself: its pinning is undone (every thread back to the CPUs it had) when the
last group started in the process closes."""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from typing import Optional

import torch

log = logging.getLogger("sidecar.engine")

ENV = "SIDECAR_CPU_BIND"
# The host's CPUs as rank 0 found them, for the workers it spawns: they inherit its affinity, which is its own
# share once a group of the process has pinned it.
HOST_ENV = "SIDECAR_CPU_BIND_HOST"
NODES = pathlib.Path("/sys/devices/system/node")

_lock = threading.Lock()
_held = 0  # groups of this process whose rank 0 pinned it
_original: Optional[set[int]] = None  # the CPUs and torch threads the process had before the first bind
_original_threads = 0


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a Linux cpulist (``0-3,8,10-11``). Raises ValueError naming ``SIDECAR_CPU_BIND`` when malformed."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"{ENV}: {text!r} is not a CPU list such as 0-3,8") from None
        if a < 0 or b < a:
            raise ValueError(f"{ENV}: {text!r} is not a CPU list such as 0-3,8")
        out.update(range(a, b + 1))
    return out


def numa_nodes() -> list[set[int]]:
    """The CPUs of each NUMA node of this host, in node order (one node where sysfs says nothing)."""
    nodes = []
    for d in sorted(NODES.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(cpus)
    return nodes


def rank_cpus(
    per_host: int, local: int, allowed: set[int], nodes: list[set[int]], spec: str = "auto"
) -> Optional[list[int]]:
    """The CPUs of the ``local``-th of ``per_host`` ranks on a host (module text), or None: not pinned.
    Raises ValueError naming ``SIDECAR_CPU_BIND`` for an explicit spec that does not fit."""
    spec = spec.strip().lower() or "auto"
    if spec == "off":
        return None
    if spec != "auto":
        sets = spec.split("|")
        if len(sets) != per_host:
            raise ValueError(f"{ENV}: {len(sets)} CPU sets for {per_host} ranks on this host")
        parsed = [parse_cpulist(x) for x in sets]
        for i, (text, cpus) in enumerate(zip(sets, parsed)):
            if not cpus or not cpus <= allowed:
                raise ValueError(f"{ENV}: CPUs {text!r} of rank {i} are not all usable here")
        return sorted(parsed[local])
    if per_host < 1 or len(allowed) < per_host:
        return None
    usable = [n & allowed for n in nodes if n & allowed]
    even = len({len(n) for n in usable}) == 1 and len(usable) % per_host == 0
    if usable and even:  # whole nodes per rank, as many each: node i to rank i * per_host // nodes
        mine: set[int] = set()
        for i, n in enumerate(usable):
            if i * per_host // len(usable) == local:
                mine |= n
        return sorted(mine)
    cpus = sorted(allowed)
    return cpus[local * len(cpus) // per_host : (local + 1) * len(cpus) // per_host]


def host_cpus() -> set[int]:
    """The CPUs the ranks of this host share: what this process had before any pinning, or what the rank 0
    that spawned it had (``HOST_ENV``)."""
    if _original is not None:
        return set(_original)
    passed = os.environ.get(HOST_ENV)
    return parse_cpulist(passed) if passed else set(os.sched_getaffinity(0))


def share_with_children() -> None:
    """Pass the host's CPUs to the workers about to be spawned (``HOST_ENV``)."""
    os.environ[HOST_ENV] = _compact(sorted(host_cpus()))


def _pin_all_threads(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (``sched_setaffinity`` of pid 0 moves the caller only)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def place(config, rank: int) -> bool:
    """Place rank ``rank``'s threads (``EngineConfig`` ``config``): pinned on a CPU host (``bind``); on a GPU
    host ``num_threads`` or CPUs / ranks host threads, unpinned. Returns whether it pinned."""
    from sidecar.model.loader import resolve_device

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if resolve_device(config.device).type == "cpu":
        return bind(world, config.nnodes, rank, config.num_threads) is not None
    torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) * config.nnodes // world))
    return False


def bind(world: int, nnodes: int, rank: int, num_threads: Optional[int]) -> Optional[list[int]]:
    """Pin this process (rank ``rank`` of ``world`` over ``nnodes`` hosts) and size torch's thread pool;
    returns the CPUs, or None where it is not pinned (threads then ``num_threads`` or CPUs / ranks)."""
    global _held, _original, _original_threads
    per_host = world // nnodes
    allowed = host_cpus()
    cpus = rank_cpus(per_host, rank % per_host, allowed, numa_nodes(), os.environ.get(ENV, "auto"))
    if cpus is None:
        torch.set_num_threads(num_threads or max(1, len(allowed) // per_host))
        if os.environ.get(ENV, "auto").strip().lower() != "off":
            log.info(
                "rank %d: threads not pinned (%d CPUs for %d ranks on this host)",
                rank,
                len(allowed),
                per_host,
            )
        return None
    with _lock:
        if _held == 0:
            _original, _original_threads = set(os.sched_getaffinity(0)), torch.get_num_threads()
        _held += 1
        _pin_all_threads(set(cpus))
    torch.set_num_threads(num_threads or len(cpus))
    log.info("rank %d: threads pinned to CPUs %s", rank, _compact(cpus))
    return cpus


def release() -> None:
    """Undo one ``bind`` of this process; the last one puts every thread back on the CPUs it had."""
    global _held, _original
    with _lock:
        if _held == 0:
            return
        _held -= 1
        if _held == 0 and _original is not None:
            _pin_all_threads(_original)
            torch.set_num_threads(_original_threads)
            _original = None


def _compact(cpus: list[int]) -> str:
    runs, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ",".join(runs)
