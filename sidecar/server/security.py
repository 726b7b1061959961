"""API keys, tenants, roles and per-key rate limits.

Tenant keys come from ``--api-key`` (repeatable) and ``--api-keys-file`` (one per
line, ``#`` comments); operator keys from ``--admin-key`` and ``--admin-keys-file``
in the same format. Each entry is ``key`` or ``key:tenant``. A key without an
explicit tenant gets a tenant derived from a hash of the key, so two different
keys never share prefix-cache blocks or semantic-cache entries unless the
operator says so by giving them the same tenant. An operator key does what a
tenant key does and also the operator actions (loading and unloading adapters).
With no keys configured auth is off and every caller is the anonymous tenant ""
with every right (a developer's local sidecar).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

Clock = Callable[[], float]


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str
    key_id: str  # safe to log: never the key itself
    operator: bool = False  # an --admin-key: may run operator actions


def _key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def parse_key_entry(entry: str, source: str = "api_keys", operator: bool = False) -> ApiKey:
    """Parse ``key`` or ``key:tenant``. Raises ValueError naming ``source``."""
    entry = entry.strip()
    key, sep, tenant = entry.partition(":")
    key, tenant = key.strip(), tenant.strip()
    if not key:
        raise ValueError(f"{source}: empty API key in entry {entry!r}")
    if any(c.isspace() for c in key):
        raise ValueError(f"{source}: API keys must not contain whitespace")
    if sep and not tenant:
        raise ValueError(f"{source}: empty tenant after ':' for key {_key_id(key)}")
    kid = _key_id(key)
    return ApiKey(key=key, tenant=tenant if sep else kid, key_id=kid, operator=operator)


def _parse_keys(
    entries: Iterable[str], keys_file: Optional[str], setting: str, operator: bool
) -> list[ApiKey]:
    """The entries of one role: ``setting`` (``api_keys`` / ``admin_keys``) and its ``_file``."""
    parsed = [parse_key_entry(e, setting, operator) for e in entries if e.strip()]
    if keys_file:
        try:
            with open(keys_file, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise ValueError(f"{setting}_file: cannot read {keys_file!r}: {exc.strerror}") from None
        for i, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if line:
                parsed.append(parse_key_entry(line, f"{setting}_file:{i}", operator))
    return parsed


def load_api_keys(
    entries: Iterable[str],
    keys_file: Optional[str] = None,
    admin_entries: Iterable[str] = (),
    admin_file: Optional[str] = None,
) -> dict[str, ApiKey]:
    """All configured keys by key string: tenant keys (``entries``, ``keys_file``) and operator keys
    (``admin_entries``, ``admin_file``). A key listed with two tenants, or as both a tenant and an
    operator key, is an error naming the key's id."""
    parsed = _parse_keys(entries, keys_file, "api_keys", False)
    parsed += _parse_keys(admin_entries, admin_file, "admin_keys", True)
    keys: dict[str, ApiKey] = {}
    for k in parsed:
        prev = keys.get(k.key)
        if prev is not None and prev.operator != k.operator:
            raise ValueError(f"admin_keys: key {k.key_id} is also listed as a tenant key (api_keys)")
        if prev is not None and prev.tenant != k.tenant:
            setting = "admin_keys" if k.operator else "api_keys"
            raise ValueError(
                f"{setting}: key {k.key_id} listed with two tenants ({prev.tenant!r}, {k.tenant!r})"
            )
        keys[k.key] = k
    return keys


class AuthError(Exception):
    def __init__(self, message: str, guess: bool = False) -> None:
        super().__init__(message)
        self.guess = guess  # a well-formed key that is wrong: what a key guesser sends


class Authenticator:
    """Maps ``authorization`` metadata to a configured key. Off when no keys are set."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenants(self) -> set[str]:
        """Every tenant a configured key belongs to."""
        return {k.tenant for k in self._keys.values()}

    def check(self, authorization: Optional[str]) -> Optional[ApiKey]:
        """Returns the key, None when auth is off; raises AuthError with a client-safe message."""
        if not self._keys:
            return None
        if not authorization:
            raise AuthError("missing API key: send 'authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("malformed authorization: expected 'Bearer <key>'")
        token = token.strip()
        # Compare against every key in constant time so timing does not reveal prefixes.
        found = None
        for key, entry in self._keys.items():
            if hmac.compare_digest(key.encode("utf-8"), token.encode("utf-8")):
                found = entry
        if found is None:
            raise AuthError("invalid API key", guess=True)
        return found


class AuthThrottle:
    """Counts failed key checks per client address: once ``limit`` failed within ``window_s``, further
    wrong keys from it are refused as rate-limited until the oldest failure ages out. A correct key is
    never refused by it (callers behind one address must not lock each other out). ``limit`` 0 turns
    it off."""

    def __init__(self, limit: int, window_s: float = 60.0, clock: Clock = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: dict[str, list[float]] = {}

    def _recent(self, peer: str, now: float) -> list[float]:
        times = [t for t in self._failures.get(peer, ()) if now - t < self.window_s]
        if times:
            self._failures[peer] = times
        else:
            self._failures.pop(peer, None)
        return times

    def wait(self, peer: str) -> Optional[float]:
        """Seconds until ``peer`` may try again, or None when it may try now."""
        if self.limit <= 0:
            return None
        with self._lock:
            now = self._clock()
            times = self._recent(peer, now)
            if len(times) < self.limit:
                return None
            return max(0.001, times[-self.limit] + self.window_s - now)

    def failed(self, peer: str) -> None:
        if self.limit <= 0:
            return
        with self._lock:
            now = self._clock()
            times = self._recent(peer, now)
            times.append(now)
            self._failures[peer] = times[-self.limit :]
            if len(self._failures) > 100_000:  # bound memory under a spray of addresses
                self._failures.pop(next(iter(self._failures)))


class TokenBucket:
    """Classic token bucket: ``capacity`` tokens, refilled at ``rate`` per second.

    Not thread-safe by itself; ``RateLimiter`` serialises access.
    """

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be > 0")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        if now > self._last:
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def wait_time(self, n: float) -> float:
        """Seconds until ``n`` tokens are available (0 when available now; inf when n > capacity)."""
        self._refill()
        if n <= self._tokens:
            return 0.0
        if n > self.capacity:
            return float("inf")
        return (n - self._tokens) / self.rate

    def take(self, n: float) -> None:
        self._refill()
        self._tokens -= n

    def give_back(self, n: float) -> None:
        self._refill()
        self._tokens = min(self.capacity, self._tokens + n)


class RateLimiter:
    """Per-key request-rate and token-rate limits.

    A request costs one request token and ``prompt + max_tokens`` tokens. Both
    buckets are checked before either is charged, so a refused request costs nothing.
    """

    def __init__(
        self, rps: float = 0.0, burst: int = 0, tpm: float = 0.0, clock: Clock = time.monotonic
    ) -> None:
        self.rps = rps
        self.burst = burst if burst > 0 else max(1, int(rps + 0.999))
        self.tpm = tpm
        self._clock = clock
        self._lock = threading.Lock()
        self._req: dict[str, TokenBucket] = {}
        self._tok: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rps > 0 or self.tpm > 0

    def acquire(self, key: str, tokens: int) -> Optional[float]:
        """Charge ``key`` for one request of ``tokens``; return None if allowed,
        else the suggested retry delay in seconds (inf when it can never fit)."""
        if not self.enabled:
            return None
        with self._lock:
            waits = []
            req = tok = None
            if self.rps > 0:
                req = self._req.get(key)
                if req is None:
                    req = self._req[key] = TokenBucket(self.rps, self.burst, self._clock)
                waits.append(req.wait_time(1))
            if self.tpm > 0:
                tok = self._tok.get(key)
                if tok is None:
                    tok = self._tok[key] = TokenBucket(self.tpm / 60.0, self.tpm, self._clock)
                waits.append(tok.wait_time(tokens))
            wait = max(waits)
            if wait > 0:
                return wait
            if req is not None:
                req.take(1)
            if tok is not None:
                tok.take(tokens)
            return None

    def charge(self, key: str, tokens: int) -> None:
        """Charge tokens after the fact (generated under a defaulted max_tokens); the bucket may go
        below zero, which delays the key's next request."""
        if self.tpm <= 0 or tokens <= 0:
            return
        with self._lock:
            tok = self._tok.get(key)
            if tok is not None:
                tok.take(tokens)

    def refund(self, key: str, tokens: int) -> None:
        """Return tokens charged up front but not used (max_tokens not all generated)."""
        if self.tpm <= 0 or tokens <= 0:
            return
        with self._lock:
            tok = self._tok.get(key)
            if tok is not None:
                tok.give_back(tokens)
