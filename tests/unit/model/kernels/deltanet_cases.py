"""Random gated DeltaNet decode cases shared by the C and Triton kernel tests: a mixer, its conv windows and
recurrent states, and the rows' slots (out of order), all built on CPU; and the check that padded rows on a
scratch row leave the real rows alone, run over each decode step (torch, C, Triton)."""

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


def padded_rows_leave_the_real_rows(step, device: torch.device = torch.device("cpu")) -> None:
    """``step(mixer, proj, b, a, (conv, recurrent), slots)`` over three rows at their slots, and over the same
    with two padded rows after them, both on one scratch row (as a padded decode bucket steps them): the real
    rows' outputs and every state row but the scratch one as without the padded rows, the scratch row finite."""
    m, conv, rec, slots, gen = case((2, 4, 8, 12), 4, torch.float32, 3, 6, 5)
    scratch = next(i for i in range(6) if i not in slots.tolist())
    proj, b, a = (x.to(device) for x in inputs(m, 5, torch.float32, gen))
    m = m.to(device)
    plain = (conv.to(device, copy=True), rec.to(device, copy=True))
    padded = (conv.to(device, copy=True), rec.to(device, copy=True))
    want = step(m, proj[:3], b[:3], a[:3], plain, slots.to(device))
    got = step(m, proj, b, a, padded, torch.cat((slots, torch.tensor([scratch, scratch]))).to(device))
    torch.testing.assert_close(got[:3], want, rtol=1e-6, atol=1e-6)
    keep = [i for i in range(6) if i != scratch]
    for ours, theirs in zip(padded, plain):
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(padded[1][scratch]).all()
