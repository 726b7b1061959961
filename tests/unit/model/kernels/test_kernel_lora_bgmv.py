"""Our CPU LoRA update (one adapter slot per row, in place) against its float64 reference."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import cpu_build, lora_bgmv


def test_kernel_builds_on_this_machine():
    assert lora_bgmv.available(), cpu_build.reason("lora_bgmv")


def _case(rows, k, part_outs, rank, slots, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(part_outs)
    offs = [0]
    for p in part_outs:
        offs.append(offs[-1] + p)
    at = torch.zeros(slots, k, lora_bgmv.at_width(n, rank))
    at[:, :, : n * rank] = torch.randn(slots, k, n * rank, generator=g) * k**-0.5
    bt = torch.zeros(slots * n * rank, offs[-1])
    for s in range(slots):
        for j in range(n):
            r0 = (s * n + j) * rank
            bt[r0 : r0 + rank, offs[j] : offs[j + 1]] = torch.randn(rank, part_outs[j], generator=g)
    x = torch.randn(rows, k, generator=g)
    out = torch.randn(rows, offs[-1], generator=g) * 4
    return x, at, bt, torch.tensor(offs, dtype=torch.int32), out


def _plan(token_slots):
    order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
    return torch.tensor([t for _, t in order], dtype=torch.long), torch.tensor(
        [s for s, _ in order], dtype=torch.long
    )


# (rows, in features, part widths, rank): SmolLM2-135M's qkv and gate/up, o with a part narrower than a
# column block, an odd width, rank above one 32-lane chunk, a long prefill
@pytest.mark.parametrize(
    "rows,k,parts,rank",
    [
        (32, 576, (576, 192, 192), 8),
        (32, 576, (1536, 1536), 8),
        (5, 96, (40,), 3),
        (7, 64, (100, 130, 70), 16),
        (300, 128, (256,), 48),
    ],
)
def test_update_matches_reference_and_leaves_base_rows_alone(rows, k, parts, rank):
    x, at, bt, offs, out = _case(rows, k, parts, rank, 4, rows + k)
    token_slots = [(t % 6) - 2 for t in range(rows)]  # slots 0..3 and base rows (-1, -2), interleaved
    rows_t, slots_t = _plan(token_slots)
    got, want = out.clone(), out.clone()
    lora_bgmv.lora_apply(x, at, bt, rows_t, slots_t, offs, got, len(parts), rank)
    lora_bgmv.reference(x, at, bt, rows_t, slots_t, offs, want, len(parts), rank)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base], out[base])  # base rows untouched, bit for bit
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, out, atol=1e-3)  # the update did change the adapter rows


def test_a_row_does_not_depend_on_the_rows_around_it():
    x, at, bt, offs, out = _case(13, 576, (576, 192, 192), 8, 4, 7)
    mixed = out.clone()
    token_slots = [0, 1, 1, 2, 0, -1, 3, 3, 3, 0, 2, 1, 0]
    lora_bgmv.lora_apply(x, at, bt, *_plan(token_slots), offs, mixed, 3, 8)
    for t, s in enumerate(token_slots):
        solo = out.clone()
        lora_bgmv.lora_apply(x, at, bt, torch.tensor([t]), torch.tensor([max(s, 0)]), offs, solo, 3, 8)
        assert torch.equal(mixed[t], solo[t] if s >= 0 else out[t]), t


def test_shapes_that_do_not_fit_are_refused():
    x, at, bt, offs, out = _case(4, 64, (32,), 8, 2, 1)
    rows, slots = _plan([0, 1, 0, 1])
    with pytest.raises(ValueError, match="lora_apply"):
        lora_bgmv.lora_apply(x.double(), at, bt, rows, slots, offs, out, 1, 8)
    with pytest.raises(ValueError, match="lora_apply"):
        lora_bgmv.lora_apply(x, at[:, :, :8], bt, rows, slots, offs, out, 1, 8)
