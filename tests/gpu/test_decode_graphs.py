"""Decode graphs on CUDA: greedy output with graphs on equals graphs off and HF float32, at every bucket
boundary; aborts during graph batches; captured graphs follow their buffers; the self-check falls back."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.input_buffers import DecodeRow
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts

MAX_NEW = 8
MAX_SEQS = 20  # buckets 1, 2, 4, 8, 16, 20


def _llm(path, **kw):
    return LLM(
        model=str(path), dtype="float32", device="cuda", max_num_seqs=MAX_SEQS, num_kv_blocks=256, **kw
    )


def _greedy(llm, prompts, max_new=MAX_NEW):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(MAX_SEQS + 1, 900, 3, 60, seed=11)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_graphs_on_equal_graphs_off_and_hf(tiny_models, prompts, kind):
    graphs = _llm(tiny_models[kind])
    eager = _llm(tiny_models[kind], enforce_eager=True)
    assert "cuda_graphs" in graphs.engine.model_info["fast_paths"], graphs.engine.model_info[
        "fast_path_fallbacks"
    ]
    assert graphs.engine.runner.graphs.captured == graphs.engine.runner.buckets == [1, 2, 4, 8, 16, 20]
    assert eager.engine.model_info["fast_paths"] == [] and not eager.engine.runner.graphs.captured
    few = prompts[:6]
    ref = hf_greedy(tiny_models[kind], few, MAX_NEW)
    assert _greedy(graphs, few) == _greedy(eager, few) == ref
    assert_pool_whole(graphs)
    assert_pool_whole(eager)


def test_every_bucket_boundary(tiny_models, prompts):
    graphs = _llm(tiny_models["qwen2"])
    eager = _llm(tiny_models["qwen2"], enforce_eager=True)
    buckets = graphs.engine.runner.buckets
    seen = []
    fill = graphs.engine.runner.inputs.fill
    graphs.engine.runner.inputs.fill = lambda rows, sample, b, w: (
        seen.append((len(rows), b)),
        fill(rows, sample, b, w),
    )
    for b in buckets:
        for n in (b, b + 1):
            if n > MAX_SEQS:
                continue
            seen.clear()
            assert _greedy(graphs, prompts[:n], 4) == _greedy(eager, prompts[:n], 4), n
            assert (n, b if n == b else buckets[buckets.index(b) + 1]) in seen
            assert_pool_whole(graphs)


def test_abort_while_a_graph_batch_runs(tiny_models, prompts):
    llm = _llm(tiny_models["llama"])
    eager = _llm(tiny_models["llama"], enforce_eager=True)
    ps = prompts[:7]
    solo = _greedy(eager, ps, 16)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=16, ignore_eos=True))
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 6:
            eng.abort("r2")
            eng.abort("r5")
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["r2"].finish_reason == "abort" and done["r5"].finish_reason == "abort"
    assert all(done[f"r{i}"].token_ids == solo[i] for i in (0, 1, 3, 4, 6))
    assert_pool_whole(llm)


def test_replay_follows_changed_buffers(tiny_models):
    """Poison: capture, then change every input; the replay must equal a fresh eager run of the new inputs,
    through the very buffers captured (their addresses never change)."""
    llm = _llm(tiny_models["mistral"])
    runner = llm.engine.runner
    dev, bs = runner.device, runner.block_size
    ptrs = (runner.inputs.buffer.data_ptr(), runner.inputs.staging.data_ptr())
    ps = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41, 42, 43, 44]]
    tables = [[1, 2], [3, 4], [5, 6]]
    ids, pos, slots, segs = [], [], [], []
    for p, t in zip(ps, tables):
        segs.append(PrefillSegment(len(ids), len(p), len(p), torch.tensor(t[: -(-len(p) // bs)], device=dev)))
        ids += p
        pos += range(len(p))
        slots += [t[i // bs] * bs + i % bs for i in range(len(p))]
    with torch.inference_mode():
        runner.model(
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            runner.kv_caches,
            AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), block_size=bs, prefills=segs),
        )

    def rows(tokens, step):
        out = []
        for p, t, tok in zip(ps, tables, tokens):
            c = len(p) + step
            out.append(DecodeRow(tok, c, t[c // bs] * bs + c % bs, c + 1, t[: c // bs + 1]))
        return out

    runner.decode_rows(rows([50, 51, 52], 0), [0, 1, 2])
    new = rows([60, 61, 62], 1)[:2] + rows([63, 64, 65], 0)[2:]  # new tokens, positions, lengths
    got = runner.decode_rows(new, [0, 1, 2]).clone()
    assert (
        4 in runner.graphs.captured
        and (runner.inputs.buffer.data_ptr(), runner.inputs.staging.data_ptr()) == ptrs
    )
    width = max(len(r.table) for r in new)
    meta = AttentionMetadata(slot_mapping=torch.tensor([r.slot for r in new], device=dev), block_size=bs)
    meta.decode_block_tables = torch.tensor([r.table + [0] * (width - len(r.table)) for r in new], device=dev)
    meta.decode_ctx_lens = torch.tensor([r.ctx_len for r in new], device=dev)
    with torch.inference_mode():
        h = runner.model(
            torch.tensor([r.token for r in new], device=dev),
            torch.tensor([r.position for r in new], device=dev),
            runner.kv_caches,
            meta,
        )
        ref = runner.model.compute_logits(h)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_self_check_falls_back_when_a_kernel_fails(tiny_models, prompts, monkeypatch):
    from sidecar.model.kernels import triton_ops  # here: a CPU-only install may lack Triton(then this skips)

    llm = _llm(tiny_models["llama"])
    runner = llm.engine.runner
    before = _greedy(llm, prompts[:3])
    assert "norm" in runner.fast_path_info()["fast_paths"]

    def failing(h, delta, weight, eps):  # the Triton norm, called only while its path is on
        raise RuntimeError("norm kernel failed to launch")

    monkeypatch.setattr(triton_ops, "add_rms_norm", failing)
    runner.prepare_fast_paths(force_check=True)
    info = runner.fast_path_info()
    assert "norm kernel failed" in info["fast_path_fallbacks"]["norm"] and "norm" not in info["fast_paths"]
    assert "cuda_graphs" in info["fast_paths"] and runner.graphs.captured == runner.buckets
    assert _greedy(llm, prompts[:3]) == before
    assert_pool_whole(llm)
