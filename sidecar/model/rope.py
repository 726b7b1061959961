"""Rotary position tables, computed as Hugging Face transformers computes them.

A model has one or more rope kinds (Gemma 3: one for its sliding-window layers, one for its global ones);
each kind is a ``RopeSpec`` and yields a cos and a sin table of ``rows`` x ``rotary_dim`` (float32 math,
stored in the model dtype, HF's attention scaling factor applied to both). Rotate-half's sign is folded into
``sin``: its first half is negated, so ``x * cos + roll(x, rotary_dim / 2) * sin`` is HF's rotation.

LongRoPE (Phi-3): HF picks the short or the long factors per forward from the largest position it holds
(long once the sequence exceeds ``original_max_position_embeddings``), and Phi-3's ``generate`` drops its
cache when a sequence grows past that length, recomputing it whole on the long factors. So a sequence of
at most that length is computed on the short factors, and a longer one on the long factors throughout (the
engine's scheduler recomputes a sequence that grows past it: ``Scheduler.rope_long_from``). The table holds
two halves: rows ``[0, L)`` give position ``p`` the short factors below the original length and the long
ones from it on (right for a decode token, whose sequence is ``p + 1`` long), and rows ``[L, 2L)`` the long
factors for every position; ``CausalLM.rope_offset(num_tokens)`` says which half a sequence's tokens read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: Optional[dict] = field(default=None, hash=False, compare=False)

    @property
    def kind(self) -> str:
        return (
            "default"
            if not self.scaling
            else self.scaling.get("rope_type", self.scaling.get("type", "default"))
        )


def inv_freq(spec: RopeSpec, dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [dim / 2] of ``spec`` over ``dim`` rotated channels (``long``: LongRoPE's long
    factors)."""
    base = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind, scaling = spec.kind, spec.scaling
    if kind == "longrope":
        factors = scaling["long_factor"] if long else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta**base)
    freq = 1.0 / (spec.theta**base)
    if kind == "default":
        return freq
    if kind == "linear":
        return freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(spec, dim)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"model: rope_scaling type {kind!r} is not supported (default, linear, llama3, longrope, yarn)"
    )


def _yarn_factor(scaling: dict) -> float:
    if scaling.get("factor") is None:
        raise ValueError("model: a yarn rope_scaling needs its factor")
    return float(scaling["factor"])


def _yarn_inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN: each frequency blended between itself (extrapolation, the fast ones) and itself / factor
    (interpolation, the slow ones) by a linear ramp over the dimensions whose rotations within the original
    length fall between ``beta_slow`` and ``beta_fast``; ``truncate`` (default on) rounds the ramp's ends
    outwards to whole dimensions. Same float32 operations as HF."""
    s = spec.scaling
    factor = _yarn_factor(s)
    orig = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_scaling(spec: RopeSpec, max_position_embeddings: int) -> float:
    """The factor HF multiplies cos and sin by (1.0 but for LongRoPE and YaRN)."""
    s = spec.scaling
    if spec.kind == "yarn":
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = _yarn_factor(s)

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if s.get("mscale") and s.get("mscale_all_dim"):
            return float(mscale(s["mscale"]) / mscale(s["mscale_all_dim"]))
        return mscale(1)
    if spec.kind != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def long_from(specs: tuple[RopeSpec, ...]) -> Optional[int]:
    """LongRoPE's original length when a kind uses it (the table then has two halves), else None."""
    for s in specs:
        if s.kind == "longrope":
            return int(s.scaling["original_max_position_embeddings"])
    return None


def _cos_sin(freq: torch.Tensor, pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos[:, None] * freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
    return emb.cos() * scale, emb.sin() * scale * sign


def tables(
    specs: tuple[RopeSpec, ...],
    rotary_dim: int,
    max_positions: int,
    max_position_embeddings: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [kinds, rows, rotary_dim]: rows = max_positions, or twice that with LongRoPE (see
    the module's docstring)."""
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    orig = long_from(specs)
    cos, sin = [], []
    for spec in specs:
        scale = attention_scaling(spec, max_position_embeddings)
        c, s = _cos_sin(inv_freq(spec, rotary_dim).to(device), pos, scale)
        if orig is not None:
            if spec.kind == "longrope":
                lc, ls = _cos_sin(inv_freq(spec, rotary_dim, long=True).to(device), pos, scale)
                c[orig:], s[orig:] = lc[orig:], ls[orig:]
            else:
                lc, ls = c, s
            c, s = torch.cat((c, lc)), torch.cat((s, ls))
        cos.append(c.to(dtype))
        sin.append(s.to(dtype))
    return torch.stack(cos), torch.stack(sin)
