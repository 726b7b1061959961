"""Qwen3.5 on CUDA: the gated DeltaNet prompt chunks' rule runs on the Triton chunked kernel
(kernels/triton/deltanet_chunk.py), which passed its start-up self-check there. The kernel at Qwen3.5-0.8B's
linear-layer shapes over a long chunk against the torch chunked form run on CPU in float32 (no TF32 there);
greedy float32 through the engine equal to HF transformers token for token with prompts split into chunks,
the KV blocks and state slots all back after."""

from __future__ import annotations

import torch

from sidecar import LLM, SamplingParams
from sidecar.model import deltanet_rule
from sidecar.model.kernels.triton import deltanet_chunk
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

NEW = 8
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 70, 1, 100])]


def test_qwen35_shapes_match_the_chunked_form():
    gen = torch.Generator().manual_seed(0)
    length, nk, nv, dk, dv = 300, 16, 16, 128, 128
    q, k = torch.randn(length, nk, dk, generator=gen), torch.randn(length, nk, dk, generator=gen)
    v = torch.randn(length, nv, dv, generator=gen)
    g, beta = -torch.rand(length, nv, generator=gen), torch.rand(length, nv, generator=gen)
    s0 = torch.randn(nv, dk, dv, generator=gen) * 0.3
    want_o, want_s = deltanet_rule.chunked_rule(q[None], k[None], v[None], g[None], beta[None], s0[None])
    state = s0.cuda()
    got = deltanet_rule.triton_rule(*(x.cuda() for x in (q, k, v, g, beta)), state)
    assert got is not None and got.is_cuda
    assert float((got.cpu() - want_o[0]).abs().max()) <= 1e-5 * (1 + float(want_o.abs().max()))
    assert float((state.cpu() - want_s[0]).abs().max()) <= 1e-5 * (1 + float(want_s.abs().max()))


def test_qwen35_prompts_on_the_triton_kernel_match_hf(tmp_path, demo_dir, monkeypatch):
    path = build_family_checkpoint("qwen3_5", tmp_path / "qwen3_5", demo_dir)
    want = hf_greedy(path, PROMPTS, NEW)
    assert_not_degenerate(want)
    calls = []
    rule = deltanet_chunk.rule

    def counted(*args):
        out = rule(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(deltanet_chunk, "rule", counted)  # counts the kernel's chunks, still runs it
    # 48 tokens a step: the 70- and 100-token prompts split, their states carried across chunk edges
    llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_batched_tokens=48)
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    assert got == want
    assert deltanet_rule.triton_rule_ready(torch.device("cuda")), deltanet_rule._checked
    assert len(calls) >= 3 * (len(PROMPTS) - 1) and all(calls)
    assert_pool_whole(llm)
