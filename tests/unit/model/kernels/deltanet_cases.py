"""Random gated DeltaNet decode cases shared by the C and Triton kernel tests: a mixer, its conv windows and
recurrent states, and the rows' slots (out of order), all built on CPU."""

from __future__ import annotations

import torch

from sidecar.model import deltanet


def case(heads, kernel, dtype, rows, slots_total, seed):
    """(mixer, conv windows, recurrent states, slots of the rows, generator) for ``heads`` (k_heads, v_heads,
    k_dim, v_dim) and a convolution of ``kernel`` taps."""
    gen = torch.Generator().manual_seed(seed)
    m = deltanet.random_mixer(heads, kernel, dtype, gen)
    conv = torch.randn(slots_total, m.conv_dim, kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(slots_total, m.nv, m.dk, m.dv, generator=gen) * 0.3
    slots = torch.randperm(slots_total, generator=gen)[:rows]
    return m, conv, rec, slots, gen


def inputs(m, rows, dtype, gen):
    """One step's in_proj rows ``proj``, ``b`` and ``a`` for ``rows`` sequences of mixer ``m``."""
    proj = (torch.randn(rows, m.conv_dim + m.nv * m.dv, generator=gen) * 2).to(dtype)
    b, a = ((torch.randn(rows, m.nv, generator=gen) * 3).to(dtype) for _ in range(2))
    return proj, b, a
