"""LoraManager: which adapters are registered, which are resident in the model's slots, and who uses them.

Invariants:
- A request naming an adapter holds a pin on the slot of that adapter from the moment it enters the
  scheduler until it finishes (stop, length, abort, error): a pinned slot is never rewritten, so an adapter
  is never swapped out (nor unloaded) under a running or preempted request.
- A request whose adapter cannot get a slot (every slot pinned by other adapters) is parked here, outside
  the scheduler, and enters it in arrival order as soon as a slot frees; it holds no KV block meanwhile.
- Unpinned resident adapters are evicted least recently used first; a slot is only written when it is
  taken for another adapter, so an adapter used again soon costs nothing.
- Each registration gets a fresh ``uid`` that enters the prefix-cache key of every block of its requests:
  adapter A never reuses adapter B's KV, nor a re-registered adapter the KV of the adapter it replaced.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

from sidecar.model.lora import Adapter, LoraLayers, read_adapter

log = logging.getLogger("sidecar.engine")

_uids = itertools.count(1)
MAX_NAME_LEN = 128


class AdapterNotFoundError(LookupError):
    """The request names an adapter that is not registered (HTTP 404 / gRPC NOT_FOUND naming ``model``)."""


@dataclass(eq=False)
class Registered:
    name: str
    adapter: Adapter
    uid: str


def check_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not name.strip()
        or len(name) > MAX_NAME_LEN
        or any(c in name for c in "\x00\x1f")
    ):
        raise ValueError(
            f"lora_name: must be a non-empty string of at most {MAX_NAME_LEN} characters, got {name!r}"
        )
    return name


class LoraManager:
    def __init__(self, model, args, max_loras: int, max_rank: int, enabled: bool) -> None:
        self.args, self.max_rank = args, max_rank
        self.layers: Optional[LoraLayers] = LoraLayers(model, max_loras, max_rank) if enabled else None
        self.registry: dict[str, Registered] = {}
        self.slot_owner: list[Optional[Registered]] = [None] * (max_loras if enabled else 0)
        self.pins = [0] * len(self.slot_owner)
        self.idle: "OrderedDict[int, None]" = OrderedDict()  # resident, unpinned slots, least recent first
        self.parked: deque = deque()
        self.counters = {"lora_loads": 0, "lora_evictions": 0}

    @property
    def enabled(self) -> bool:
        return self.layers is not None

    # -- registration (engine thread; reading the files may happen anywhere: see read) -----------------------
    def read(self, path: str) -> Adapter:
        """Validate the adapter at ``path`` against this base model (no engine state touched)."""
        return read_adapter(path, self.args, self.max_rank)

    def register(self, name: str, adapter: Adapter) -> None:
        """Make ``adapter`` servable as ``name``. Raises ValueError when LoRA is off or the name is taken."""
        if not self.enabled:
            raise ValueError(
                "lora: adapters are not enabled (start with lora_modules / --lora, or enable_lora)"
            )
        check_name(name)
        if name in self.registry:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded (unload it first)")
        self.registry[name] = Registered(name, adapter, f"{name}#{next(_uids)}")
        log.info("lora adapter %r registered from %s (rank %d)", name, adapter.path, adapter.rank)

    def unregister(self, name: str) -> None:
        """New requests can no longer name it; requests already holding it finish with it (their pins keep
        its slot) and its slot is free for reuse afterwards. Raises AdapterNotFoundError."""
        entry = self.registry.pop(name, None)
        if entry is None:
            raise AdapterNotFoundError(f"lora_name: adapter {name!r} is not loaded")
        for slot, owner in enumerate(self.slot_owner):
            if owner is entry and self.pins[slot] == 0:
                self.slot_owner[slot] = None
                self.idle.pop(slot, None)
        log.info("lora adapter %r unregistered", name)

    def names(self) -> dict[str, str]:
        """Registered adapter name -> its path."""
        return {n: e.adapter.path for n, e in self.registry.items()}

    # -- requests ------------------------------------------------------------------------------------------
    def admit(self, req, name: Optional[str]) -> bool:
        """Bind ``req`` to adapter ``name`` (None: the base model). True when it may enter the scheduler now;
        False when it was parked. Raises AdapterNotFoundError before changing anything."""
        req.lora, req.lora_slot = None, None
        if name is None:
            return True
        entry = self.registry.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"model: {name!r} is neither the base model nor a loaded adapter")
        req.lora = entry
        req.cache_salt = (req.cache_salt or "") + "\x1flora:" + entry.uid
        if not self.parked and self._pin(req):
            return True
        self.parked.append(req)
        return False

    def _pin(self, req) -> bool:
        entry = req.lora
        slot = next((s for s, o in enumerate(self.slot_owner) if o is entry), None)
        if slot is None:
            free = [s for s, o in enumerate(self.slot_owner) if o is None]
            if free:
                slot = free[0]  # the lowest: the update then spans fewer slots
            elif self.idle:
                slot = next(iter(self.idle))
                self.counters["lora_evictions"] += 1
            else:
                return False
            self.layers.load(slot, entry.adapter)
            self.slot_owner[slot] = entry
            self.counters["lora_loads"] += 1
        self.idle.pop(slot, None)
        self.pins[slot] += 1
        req.lora_slot = slot
        return True

    def release(self, req) -> None:
        """Drop ``req``'s pin (or its place among the parked). Idempotent."""
        if getattr(req, "lora", None) is None:
            return
        if req.lora_slot is None:
            if req in self.parked:
                self.parked.remove(req)
            return
        slot, req.lora_slot = req.lora_slot, None
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            if self.registry.get(req.lora.name) is req.lora:
                self.idle[slot] = None  # most recently used last
            else:  # unregistered while in use: its slot is free now
                self.slot_owner[slot] = None

    def unpark(self) -> list:
        """Parked requests that got a slot now, in arrival order (the first that cannot waits, and all after it)."""
        out = []
        while self.parked and self._pin(self.parked[0]):
            out.append(self.parked.popleft())
        return out

    def expired(self, now: float) -> list:
        """Parked requests whose deadline (time.monotonic()) has passed; the caller finishes them."""
        return [r for r in self.parked if r.deadline is not None and r.deadline <= now]

    def token_slots(self, reqs_and_counts: Sequence[tuple[object, int]]) -> Optional[list[int]]:
        """Per-token slot list for a forward of these (request, tokens) spans, or None when none uses an adapter."""
        if not any(getattr(r, "lora_slot", None) is not None for r, _ in reqs_and_counts):
            return None
        out: list[int] = []
        for r, n in reqs_and_counts:
            slot = r.lora_slot
            out.extend([-1 if slot is None else slot] * n)
        return out

    def set_batch(self, token_slots: Optional[list[int]]) -> None:
        """The slot of every token of the next forward (see ``token_slots``); None after it."""
        if self.layers is not None:
            self.layers.set_batch(token_slots)

    def stats(self) -> dict:
        return {
            "lora_adapters": len(self.registry),
            "lora_resident": sum(o is not None for o in self.slot_owner),
            "lora_pinned": sum(1 for p in self.pins if p),
            "lora_parked": len(self.parked),
            **self.counters,
        }
