"""Per-request cache policy: whether to look up and whether to store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

CACHE_CONTROLS = ("default", "skip", "refresh", "only")


@dataclass
class CachePolicy:
    lookup: bool
    store: bool
    bypass_reason: Optional[str]  # set when the request does not consult the cache


def cache_policy(
    cache_control: str, temperature: float, cache_sampled: bool, enabled: bool, allow_sampled: bool
) -> CachePolicy:
    """Decide what the cache does for one request.

    - ``default``: look up, store the generation on a miss.
    - ``skip``: neither look up nor store.
    - ``refresh``: do not look up, generate and overwrite the stored answer.
    - ``only``: look up and never generate; the caller turns a miss into a not-found error.
      ``only`` never bypasses silently: if the cache is disabled or the request is sampled,
      ``lookup`` is False and the caller must answer not-found, not generate.

    Sampled requests (temperature > 0) ask for varied answers, so serving a stored one
    changes their meaning; they bypass unless the request (``cache_sampled``) or the
    server (``allow_sampled``) opts in.
    """
    control = (cache_control or "default").strip().lower()
    if control not in CACHE_CONTROLS:
        raise ValueError(f"cache_control: must be one of {', '.join(CACHE_CONTROLS)}, got {cache_control!r}")
    if temperature is None or temperature < 0:
        raise ValueError(f"sampling.temperature: must be >= 0, got {temperature}")
    if not enabled:
        return CachePolicy(False, False, "disabled")
    if control == "skip":
        return CachePolicy(False, False, "skip")
    if temperature > 0 and not (cache_sampled or allow_sampled):
        return CachePolicy(False, False, "sampled")
    if control == "refresh":
        return CachePolicy(False, True, "refresh")
    if control == "only":
        return CachePolicy(True, False, None)
    return CachePolicy(True, True, None)
