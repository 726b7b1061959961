"""The Triton gated DeltaNet decode step (kernels/triton/deltanet.py) against the torch reference of a decode
step (model/deltanet.py ``decode_reference``): the gated output, the convolution windows and the recurrent
states of the slots it advances (out of order), over several steps each reading back the states the last one
wrote, other slots untouched; padded rows sharing a scratch row leaving the real rows alone; the arguments it
refuses, nothing touched; its start-up self-check; and a tiny Qwen3.5's decode rows through it equal to HF
transformers' greedy float32 token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import deltanet
from sidecar.model.kernels.triton import deltanet as triton_deltanet
from tests.unit.model.kernels.deltanet_cases import case as _case, inputs as _inputs
from tests.unit.model.kernels.deltanet_cases import padded_rows_leave_the_real_rows
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

BF16_ULP = 2.0**-7


def test_self_check_passes(device):
    assert deltanet._self_check(triton_deltanet.decode, str(device)) == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kernel,rows",
    [
        ((16, 16, 128, 128), 4, 1),  # Qwen3.5-0.8B's linear layers, batch 1
        ((2, 4, 8, 12), 4, 3),  # value heads over key heads, head sizes under a tile
        ((4, 8, 32, 16), 3, 5),
        ((1, 2, 20, 33), 2, 2),
    ],
)
def test_steps_match_the_torch_reference(heads, kernel, rows, dtype, device):
    ref, conv, rec, slots, gen = _case(heads, kernel, dtype, rows, rows + 3, sum(heads) + rows)
    m = copy.deepcopy(ref).to(device)
    ours, theirs = (conv.to(device, copy=True), rec.to(device, copy=True)), (conv.clone(), rec.clone())
    idle = torch.ones(rows + 3, dtype=torch.bool)
    idle[slots] = False
    for _ in range(3):
        proj, b, a = _inputs(ref, rows, dtype, gen)
        on = [x.to(device) for x in (proj, b, a)]
        got = deltanet.kernel_step(m, *on, ours, slots.to(device), triton_deltanet.decode)
        want = deltanet.decode_reference(ref, proj, b, a, theirs, slots)
        assert got is not None and got.dtype == dtype and got.shape == want.shape and got.device == device
        got, window, state = got.cpu(), ours[0].cpu(), ours[1].cpu()
        assert torch.isfinite(got).all()
        # the window holds the last inputs, copied: equal to the bit
        assert torch.equal(window, theirs[0])
        # the decayed state and its update round as torch's; only the order of the sums S^T k differs
        scale = float(theirs[1].abs().max())
        assert float((state - theirs[1]).abs().max()) <= 1e-5 * scale
        if dtype == torch.float32:  # the sums' order (conv taps, S^T q, norms) and exp/log differ
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
        else:  # rounded where torch rounds: equal but where a value in the chain o -> normed -> weighted
            # sat on a bf16 rounding edge (that one rounding flipped moves the output by up to two ulps)
            g, w = got.double(), want.double()
            off = (g - w).abs() > 2 * BF16_ULP * torch.maximum(g.abs(), w.abs())
            assert not off.any()
            assert float((got != want).float().mean()) < 0.01
    assert torch.equal(ours[0].cpu()[idle], conv[idle]) and torch.equal(ours[1].cpu()[idle], rec[idle])


def test_refused_arguments_touch_nothing(device):
    m, conv, rec, slots, gen = _case((2, 4, 8, 12), 4, torch.float32, 2, 4, 0)
    m = m.to(device)
    proj, b, a, conv, rec, slots = (
        x.to(device) for x in (*_inputs(m, 2, torch.float32, gen), conv, rec, slots)
    )
    state = (conv.clone(), rec.clone())
    step = triton_deltanet.decode

    def untouched():
        return torch.equal(state[0], conv) and torch.equal(state[1], rec)

    # float16 activations: a dtype the kernel does not take
    half = deltanet.random_mixer((2, 4, 8, 12), 4, torch.float16, gen).to(device)
    s16 = (conv.half(), rec.clone())
    assert deltanet.kernel_step(half, proj.half(), b.half(), a.half(), s16, slots, step) is None
    assert torch.equal(s16[0], conv.half()) and torch.equal(s16[1], rec)
    # rows of another width, int32 slots, slots on another device than the rows
    assert deltanet.kernel_step(m, proj[:, 1:], b, a, state, slots, step) is None and untouched()
    assert deltanet.kernel_step(m, proj, b, a, state, slots.int(), step) is None and untouched()
    if device.type == "cuda":
        assert deltanet.kernel_step(m, proj, b, a, state, slots.cpu(), step) is None and untouched()
    # a head wider than a state tile the kernel holds
    wide = deltanet.random_mixer((1, 1, triton_deltanet.MAX_DIM + 1, 4), 2, torch.float32, gen).to(device)
    big = (
        torch.zeros(2, wide.conv_dim, 1, device=device),
        torch.zeros(2, 1, triton_deltanet.MAX_DIM + 1, 4, device=device),
    )
    p, bb, aa = (x.to(device) for x in _inputs(wide, 1, torch.float32, gen))
    assert deltanet.kernel_step(wide, p, bb, aa, big, torch.tensor([0], device=device), step) is None


PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([6, 13, 1])]
NEW = 6


def test_qwen35_decode_through_the_kernel_matches_hf(tmp_path, demo_dir, monkeypatch, device):
    path = build_family_checkpoint("qwen3_5", tmp_path / "qwen3_5", demo_dir)
    want = hf_greedy(path, PROMPTS, NEW)
    assert_not_degenerate(want)
    assert deltanet.triton_ready(device)  # the self-check's own steps done before counting
    rows = []
    decode = triton_deltanet.decode

    def counted(*args):
        out = decode(*args)
        rows.append(None if out is None else out.shape[0])
        return out

    monkeypatch.setattr(triton_deltanet, "decode", counted)  # counts the kernel's steps, still runs it
    deltanet.use_triton_on_cpu(True)
    try:
        llm = LLM(model=str(path), dtype="float32", device=device.type, enforce_eager=True)
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    finally:
        deltanet.use_triton_on_cpu(False)
    assert got == want
    # every decode step of every linear layer ran on the kernel, batches of all three rows included
    steps = [r for r in rows if r is not None]
    assert None not in rows and len(steps) >= 3 * (NEW - 1) and max(steps) == len(PROMPTS)


def test_padded_rows_on_a_scratch_row_leave_the_real_rows(device):
    padded_rows_leave_the_real_rows(
        lambda m, *args: deltanet.kernel_step(m, *args, triton_deltanet.decode), device
    )
