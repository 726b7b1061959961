"""The Triton gated DeltaNet prompt rule (kernels/triton/deltanet_chunk.py) against the torch chunked form
(deltanet_rule.py ``chunked_rule``, itself checked against HF's in tests/unit/model/test_hybrid_vs_hf.py): the
output and the slot's state over a sequence split in two calls (the state read back), across the kernel's
token blocks and column tiles, grouped key heads, other slots untouched; bf16 inputs through ``triton_rule``;
the arguments it refuses, nothing touched; its start-up self-check; and a tiny Qwen3.5's prompt chunks
through it equal to HF transformers' greedy float32 token for token."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model import deltanet, deltanet_rule
from sidecar.model.kernels.triton import deltanet_chunk
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

BF16_ULP = 2.0**-7


def _chunk(length, heads, gen, decay=1.0):
    nk, nv, dk, dv = heads
    q, k = torch.randn(length, nk, dk, generator=gen), torch.randn(length, nk, dk, generator=gen)
    v = torch.randn(length, nv, dv, generator=gen)
    g = -torch.rand(length, nv, generator=gen) * decay
    return q, k, v, g, torch.rand(length, nv, generator=gen)


def _normed(q, k):
    return (deltanet_rule.l2norm(q) / q.shape[-1] ** 0.5).contiguous(), deltanet_rule.l2norm(k).contiguous()


def test_self_check_passes(device):
    assert deltanet_rule._rule_check(deltanet_chunk.rule, str(device)) == ""
    assert deltanet_rule.triton_rule_ready(device)


@pytest.mark.parametrize(
    "heads,chunk,block_v,decay",
    [
        ((2, 4, 20, 40), 16, 16, 1.0),  # value heads over key heads; three column tiles, the last partial
        ((1, 1, 8, 6), 16, 32, 4.0),  # heads under a tile; strong decays
        ((2, 2, 16, 24), 32, 16, 0.1),  # a sequence within one token block per call
    ],
)
def test_rule_matches_the_chunked_form_across_calls(heads, chunk, block_v, decay, device):
    gen = torch.Generator().manual_seed(sum(heads) + chunk)
    nk, nv, dk, dv = heads
    length, cut = 45, 19
    q, k, v, g, beta = _chunk(length, heads, gen, decay)
    rec = torch.randn(3, nv, dk, dv, generator=gen) * 0.3  # three slots; the sequence owns slot 1
    want_o, want_s = deltanet_rule.chunked_rule(q[None], k[None], v[None], g[None], beta[None], rec[1:2])
    qn, kn = _normed(q, k)
    # v, g and beta as views of wider rows (the kernel reads rows at any stride)
    vw = torch.cat((v.flatten(1), torch.randn(length, 3, generator=gen)), 1)[:, : nv * dv].view(
        length, nv, dv
    )
    gb = torch.cat((g, beta), 1)
    ours = rec.to(device, copy=True)
    parts = []
    for rows in (slice(0, cut), slice(cut, length)):
        args = (qn[rows], kn[rows], vw[rows], gb[rows, :nv], gb[rows, nv:])
        o = deltanet_chunk.rule(*(x.to(device) for x in args), ours[1], chunk=chunk, block_v=block_v)
        assert o is not None and o.dtype == torch.float32 and o.device == device
        parts.append(o.cpu())
    got = torch.cat(parts)
    assert torch.isfinite(got).all()
    # float32 products: only the order of the sums and the solve (T as a product of factors) differ
    scale = 1 + float(want_o.abs().max())
    assert float((got - want_o[0]).abs().max()) <= 1e-5 * scale
    assert float((ours[1].cpu() - want_s[0]).abs().max()) <= 1e-5 * (1 + float(want_s.abs().max()))
    assert torch.equal(ours[0].cpu(), rec[0]) and torch.equal(ours[2].cpu(), rec[2])


def test_bf16_chunk_through_triton_rule(device):
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _chunk(40, (2, 4, 20, 40), gen)
    s0 = torch.randn(4, 20, 40, generator=gen) * 0.3
    bf = [x.bfloat16() for x in (q, k, v)]
    state = s0.to(device, copy=True)
    got = deltanet_rule.triton_rule(*(x.to(device) for x in (*bf, g, beta)), state)
    want_o, want_s = deltanet_rule.chunked_rule(*(x[None] for x in bf), g[None], beta[None], s0[None])
    assert got is not None and got.dtype == torch.bfloat16
    # float32 inside, rounded to bf16 once: two ulps where a float32 difference crossed a rounding edge
    torch.testing.assert_close(got.cpu().float(), want_o[0].float(), rtol=2 * BF16_ULP, atol=2 * BF16_ULP)
    assert float((state.cpu() - want_s[0]).abs().max()) <= 1e-5 * (1 + float(want_s.abs().max()))


def test_refused_arguments_touch_nothing(device):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = (x.to(device) for x in _chunk(5, (2, 4, 8, 12), gen))
    q, k = _normed(q, k)
    state = torch.randn(4, 8, 12, generator=gen).to(device)
    before = state.clone()
    rule = deltanet_chunk.rule
    for args, kw in (
        ((q.double(), k, v, g, beta, state), {}),  # not float32
        ((q, k, v.transpose(1, 2), g, beta, state), {}),  # a row's elements not packed
        ((q, k, v, g[:4], beta, state), {}),  # a gate row short
        ((q, k, v, g, beta, state[:3]), {}),  # a state head short
        ((q[:, :1].repeat(1, 3, 1), k[:, :1].repeat(1, 3, 1), v, g, beta, state), {}),  # 4 value heads, 3 key
        ((q, k, v, g, beta, state), {"chunk": 24}),  # a token block not a power of two
        ((q, k, v, g, beta, state), {"block_v": 8}),  # a column tile under a dot's 16
    ):
        assert rule(*args, **kw) is None
    wide = torch.zeros(1, 1, deltanet_chunk.MAX_DIM + 1, device=device)
    big = torch.zeros(1, deltanet_chunk.MAX_DIM + 1, 12, device=device)
    assert rule(wide, wide, v[:1, :1], g[:1, :1], beta[:1, :1], big) is None
    assert torch.equal(state, before)
    empty = rule(q[:0], k[:0], v[:0], g[:0], beta[:0], state)
    assert empty is not None and empty.shape == (0, 4, 12) and torch.equal(state, before)


PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([40, 7, 1])]
NEW = 4


def test_qwen35_prompts_through_the_kernel_match_hf(tmp_path, demo_dir, monkeypatch, device):
    path = build_family_checkpoint("qwen3_5", tmp_path / "qwen3_5", demo_dir)
    want = hf_greedy(path, PROMPTS, NEW)
    assert_not_degenerate(want)
    assert deltanet_rule.triton_rule_ready(device)  # the self-check's own chunk done before counting
    lengths = []
    rule = deltanet_chunk.rule

    def counted(q, *args):
        out = rule(q, *args)
        lengths.append(None if out is None else q.shape[0])
        return out

    monkeypatch.setattr(deltanet_chunk, "rule", counted)  # counts the kernel's chunks, still runs it
    deltanet.use_triton_on_cpu(False, prompts=True)
    try:
        # 24 tokens a step: the 40-token prompt in two chunks, its state carried between them
        llm = LLM(
            model=str(path),
            dtype="float32",
            device=device.type,
            enforce_eager=True,
            max_num_batched_tokens=24,
        )
        got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    finally:
        deltanet.use_triton_on_cpu(False)
    assert got == want
    # every prompt chunk of every linear layer ran on the kernel, the long prompt split
    assert None not in lengths and len(lengths) >= 3 * len(PROMPTS) and max(lengths) < 40
    assert sum(lengths) == 3 * sum(len(p) for p in PROMPTS if len(p) > 1)  # one token: a decode row
