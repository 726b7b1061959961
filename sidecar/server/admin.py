"""Operator actions: where run-time adapters may come from, which tenant sees which adapter, and the
audit trail.

- Run-time adapters are read only from under the ``--lora-root`` directories. The path is resolved
  (symlinks, ``..``) before the check, and so is every symbolic link directly inside the adapter
  directory (its config and weights). Every refused path gets the same message, so the refusal says
  nothing about what exists on the host.
- An adapter is global (every tenant sees it) or scoped to one tenant: only that tenant's requests may
  name it, and to every other tenant it is as unknown as a name never loaded.
- An adapter is never unloaded under a request: unloading one that requests are using is refused
  (``failed_precondition`` naming ``lora_name``) until they have finished.
- Each operator action is logged once on the ``sidecar.audit`` logger with the caller's key id (a hash,
  never the key), its role and tenant, the action and its result.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Optional

from sidecar.server.validation import ServiceError

AUDIT = logging.getLogger("sidecar.audit")
# Operator actions are rare and must not vanish with --log-level warning.
AUDIT.setLevel(logging.INFO)

LOAD_LORA = "load_lora_adapter"
UNLOAD_LORA = "unload_lora_adapter"
OPERATOR_ACTIONS = (LOAD_LORA, UNLOAD_LORA)

REFUSED_PATH = "lora_path: not an adapter directory under an allowed --lora-root directory"
NO_ROOTS = (
    "lora_path: loading adapters at run time is off; start the sidecar with --lora-root DIR "
    "(repeatable) to allow adapters from under DIR"
)


def audit(caller: Any, action: str, result: str, **details: Any) -> None:
    """One audit line: who (key id, role, tenant), what (action and its details), and the result ("ok"
    or the refusal's code)."""
    AUDIT.info(
        "operator action",
        extra={
            "key_id": caller.key_id or "anonymous",
            "role": "operator" if caller.operator else "tenant",
            "tenant": caller.tenant,
            "action": action,
            "result": result,
            **{k: v for k, v in details.items() if v is not None},
        },
    )


class LoraRoots:
    """The directories run-time adapters may be read from. Raises ValueError naming ``lora_roots`` when
    one is not a directory."""

    def __init__(self, roots: Iterable[str]) -> None:
        resolved = []
        for r in roots:
            real = os.path.realpath(os.path.expanduser(r))
            if not os.path.isdir(real):
                raise ValueError(f"lora_roots: {r!r} is not a directory")
            resolved.append(real)
        self.roots = tuple(resolved)

    def _under(self, real: str) -> bool:
        return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self.roots)

    def _links_inside(self, real: str) -> bool:
        """Whether every symbolic link directly in ``real`` resolves under a root (True when ``real`` cannot
        be listed: the engine then reports the path, which lies under a root)."""
        try:
            with os.scandir(real) as entries:
                return all(self._under(os.path.realpath(e.path)) for e in entries if e.is_symlink())
        except OSError:
            return True

    def resolve(self, path: str) -> str:
        """``path`` resolved, when it lies under a root; raises invalid_argument naming ``lora_path``."""
        if not self.roots:
            raise ServiceError("invalid_argument", NO_ROOTS, field="lora_path")
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):  # a NUL byte, a loop: refused like any other path
            raise ServiceError("invalid_argument", REFUSED_PATH, field="lora_path") from None
        if not self._under(real) or not self._links_inside(real):
            raise ServiceError("invalid_argument", REFUSED_PATH, field="lora_path")
        return real


class AdapterScopes:
    """Which tenant may name which adapter, and how many requests are using each one.

    Adapters not listed in ``owner`` are global. A name being unloaded is hidden from new requests at
    once, before the engine forgets it."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # tenant-scoped adapter -> its tenant
        self.users: dict[str, int] = {}  # adapter -> requests using it now
        self.unloading: set[str] = set()

    def visible(self, adapters: dict[str, str], tenant: Optional[str]) -> dict[str, str]:
        """The adapters (name -> path) ``tenant`` may name; None: only the global ones."""
        return {
            n: p
            for n, p in adapters.items()
            if n not in self.unloading and (n not in self.owner or self.owner[n] == tenant)
        }

    def hold(self, name: Optional[str]) -> None:
        if name is not None:
            self.users[name] = self.users.get(name, 0) + 1

    def release(self, name: Optional[str]) -> None:
        if name is not None:
            left = self.users.get(name, 0) - 1
            if left > 0:
                self.users[name] = left
            else:
                self.users.pop(name, None)

    def begin_unload(self, name: str) -> None:
        """Hide ``name`` from new requests; raises failed_precondition when requests are using it."""
        n = self.users.get(name, 0)
        if n:
            raise ServiceError(
                "failed_precondition",
                f"lora_name: adapter {name!r} is in use by {n} running request(s); "
                "unload it once they have finished",
                field="lora_name",
            )
        self.unloading.add(name)

    def end_unload(self, name: str, removed: bool) -> None:
        self.unloading.discard(name)
        if removed:
            self.owner.pop(name, None)
