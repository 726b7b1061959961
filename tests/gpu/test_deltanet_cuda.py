"""Qwen3.5 on CUDA: the gated DeltaNet decode rows run on the Triton kernel (kernels/triton/deltanet.py),
which passed its start-up self-check there; greedy float32 equals HF transformers token for token, sequences
of different lengths decoding in one batch, the KV blocks all back after."""

from __future__ import annotations

import torch

from sidecar import LLM, SamplingParams
from sidecar.model import deltanet
from sidecar.model.kernels.triton import deltanet as triton_deltanet
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint

NEW = 16
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 70, 1])]


def test_qwen35_decode_on_the_triton_kernel_matches_hf(tmp_path, demo_dir, monkeypatch):
    path = build_family_checkpoint("qwen3_5", tmp_path / "qwen3_5", demo_dir)
    want = hf_greedy(path, PROMPTS, NEW)
    assert_not_degenerate(want)
    calls = []
    decode = triton_deltanet.decode

    def counted(*args):
        out = decode(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(triton_deltanet, "decode", counted)  # counts the kernel's launches, still runs it
    llm = LLM(model=str(path), dtype="float32", device="cuda")
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]
    assert got == want
    assert deltanet.triton_ready(torch.device("cuda")), deltanet._checked
    assert len(calls) >= 3 * (NEW - 1) and all(calls)
    assert_pool_whole(llm)
