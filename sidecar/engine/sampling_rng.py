"""Counter-based random draws for sampling.

Every random number the sampler uses is a pure function of (stream, position, salt, vocabulary index),
computed with torch integer ops on the logits' device: no stateful generator, nothing shared between
requests. A request's stream is its seed (seeded requests) or the engine seed mixed with a per-request
number (unseeded ones); the position is that of the token being sampled in the request's sequence; the
salt separates independent uses of one position (the token draw, a speculative acceptance test, a
grammar re-draw). So a seeded request's tokens never depend on the batch, its size or its row.

The hash is splitmix64: element i of the sequence keyed by k is fmix(k + (i + 1) * GOLDEN). int64 tensors
wrap on overflow on every torch device, which is exactly the mod-2^64 arithmetic the hash needs; right
shifts of signed ints are arithmetic, so logical shifts mask the sign copies off.
"""

from __future__ import annotations

import torch

from sidecar.model.kernels.cpu import keyed_uniform

_U64 = (1 << 64) - 1
NUM_SALTS = 4  # salts per position; a salt is in [0, NUM_SALTS)
SALT_TOKEN = 0  # the draw of the token itself (sampling, and a verification's residual or bonus draw)
SALT_REDRAW = 1  # a second token draw at the same position (a grammar refused the first)
SALT_ACCEPT = 2  # the uniform of a speculative acceptance test


def to_s64(x: int) -> int:
    """The int64 with the same low 64 bits as ``x``."""
    x &= _U64
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = to_s64(0x9E3779B97F4A7C15)
_M1 = to_s64(0xBF58476D1CE4E5B9)
_M2 = to_s64(0x94D049BB133111EB)


def fmix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int, as a signed 64-bit value (equal to ``fmix_`` on a tensor)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return to_s64(x ^ (x >> 31))


def _lsr_xor_(x: torch.Tensor, s: int) -> torch.Tensor:
    """In place: x ^= x >>> s (logical shift of the 64-bit pattern)."""
    return x.bitwise_xor_(torch.bitwise_right_shift(x, s).bitwise_and_((1 << (64 - s)) - 1))


def fmix_(x: torch.Tensor) -> torch.Tensor:
    """In place on an int64 tensor: splitmix64's finaliser (a bijection of 64-bit patterns)."""
    _lsr_xor_(x, 30).mul_(_M1)
    _lsr_xor_(x, 27).mul_(_M2)
    return _lsr_xor_(x, 31)


def stream_for(seed: int | None, engine_seed: int, number: int) -> int:
    """A request's stream: its own seed, or for unseeded requests the engine seed mixed with the request's
    number (distinct per request, reproducible for one engine seed and arrival order)."""
    if seed is not None:
        return to_s64(seed)
    return fmix_int(fmix_int(engine_seed ^ 0x5EED) + (number + 1) * GOLDEN)


def row_keys(streams: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """int64 [B] keys of the draws at (stream, position, salt); a new tensor."""
    k = fmix_(streams.clone()).add_((positions * NUM_SALTS + (salt + 1)) * GOLDEN)
    return fmix_(k)


def row_key_int(stream: int, position: int, salt: int) -> int:
    return fmix_int(fmix_int(stream) + (position * NUM_SALTS + salt + 1) * GOLDEN)


_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _offsets(device: torch.device, n: int) -> torch.Tensor:
    """(i + 1) * GOLDEN for i < n, wrapped to int64: the per-element counter of the splitmix sequence."""
    t = _OFFSETS.get((device, n))
    if t is None:
        t = _OFFSETS[(device, n)] = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(GOLDEN)
    return t


def unit_float(h: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from 64-bit hashes: the top 23 bits select a cell of a 2^23 grid and the
    value is the cell's centre. Every centre (k + 0.5) * 2^-23 is exact in float32, so the extremes are
    2^-24 and 1 - 2^-24: neither 0 nor 1 occurs, and both logs of the exponential race stay finite (a
    24-bit grid would round its top centre to 1.0, whose noise is infinite)."""
    return torch.bitwise_right_shift(h, 41).bitwise_and_((1 << 23) - 1).float().add_(0.5).mul_(2.0**-23)


def uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [B, n] uniforms in (0, 1): element (b, i) of the sequence keyed by keys[b]. On the CPU one C
    pass computes the same bits (``keyed_uniform``) where the torch form's dozen passes over [B, n] would take
    most of a sampled step's host time."""
    fast = keyed_uniform.uniform(keys, n)
    return fast if fast is not None else uniform_torch(keys, n)


def uniform_torch(keys: torch.Tensor, n: int) -> torch.Tensor:
    """``uniform`` in torch operators on any device: the definition."""
    return unit_float(fmix_(keys.unsqueeze(-1) + _offsets(keys.device, n)))


def gumbel(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [B, n] standard Gumbel noise -log(E), E = -log(U) ~ Exp(1): argmax(logits / T + noise) is
    the exponential race argmax(p / E), an exact draw from softmax(logits / T)."""
    return uniform(keys, n).log_().neg_().log_().neg_()


class KeyedDraws:
    """One request's draws from ``position`` on, for speculative verification: the token at position
    ``position + i`` uses the same keys as the sampler would, so verification and plain sampling share one
    random sequence per request."""

    def __init__(self, stream: int, position: int) -> None:
        self.stream = stream
        self.position = position

    def uniform(self, i: int) -> float:
        """The acceptance-test uniform in (0, 1) for the token at ``position + i`` (cell centres of a 2^52
        grid, all exact in float64, as in ``unit_float``)."""
        h = fmix_int(row_key_int(self.stream, self.position + i, SALT_ACCEPT) + GOLDEN) & _U64
        return ((h >> 12) + 0.5) * 2.0**-52

    def categorical(self, probs: torch.Tensor, i: int) -> int:
        """A draw from ``probs`` (unnormalised weights, [V]) for the token at ``position + i``: the
        exponential race argmax(probs / E) with the token draw's keys."""
        key = torch.tensor([row_key_int(self.stream, self.position + i, SALT_TOKEN)], device=probs.device)
        e = uniform(key, probs.shape[-1])[0].log_().neg_()
        return int((probs.float() / e).argmax())
