"""Device fast paths on this GPU for quantized KV caches and quantized weights: none falls back at the
self-check; with int8/fp8 KV (float32 arithmetic) greedy output equals the eager reference of the same
configuration; the Triton weight-only layers agree with the reference layers at the real model's shapes,
split over K or not, for every decode-sized batch. The one-row fused products survive the self-check, give
HF's float32 tokens one request at a time (the batch-1 graph), and agree with cuBLAS and the separate
kernels at the real model's shapes."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.quant import Int4Linear, Int8Linear
from sidecar.model.quant_format import quantize_int4, quantize_int8
from tests.gpu.test_decode_graphs import _greedy, _llm
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_paths_survive_and_match_eager(tiny_models, kv_cache_dtype):
    fast = _llm(tiny_models["qwen2"], kv_cache_dtype=kv_cache_dtype)
    eager = _llm(tiny_models["qwen2"], enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    info = fast.engine.model_info
    assert info["fast_path_fallbacks"] == {}, info["fast_path_fallbacks"]
    assert {"attention", "rope_kv", "norm", "silu_mul", "cuda_graphs"} <= set(info["fast_paths"])
    prompts = make_prompts(9, 900, 3, 60, seed=5)
    assert _greedy(fast, prompts) == _greedy(eager, prompts)
    assert_pool_whole(fast)
    assert_pool_whole(eager)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_path_survives_the_self_check(tiny_models, quantization, dtype):
    llm = LLM(
        model=str(tiny_models["qwen2"]),
        dtype=dtype,
        device="cuda",
        max_num_seqs=8,
        num_kv_blocks=128,
        quantization=quantization,
        quant_group_size=32,
    )
    info = llm.engine.model_info
    assert info["fast_path_fallbacks"] == {}, info["fast_path_fallbacks"]
    assert "weight_only" in info["fast_paths"] and "cuda_graphs" in info["fast_paths"]
    outs = llm.generate(make_prompts(4, 900, 3, 30, seed=7), SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6] * 4
    assert_pool_whole(llm)


def _layer(mode: str, n: int, k: int, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen).to(dtype).cuda() if bias else None
    if mode == "int8":
        q, s = quantize_int8(w, torch.float32)
        layer = Int8Linear(q.cuda(), s.cuda(), k, b, dtype)
    else:
        q, s, z = quantize_int4(w, 128, torch.float32)
        layer = Int4Linear(q.cuda(), s.cuda(), z.cuda(), k, b, dtype)
    paths = FastPaths()
    layer.set_fast_paths(paths)
    return layer.cuda(), paths


# The Qwen2-0.5B decode layers (qkv with bias, o, gate/up, down): split over K where the columns alone
# would leave multiprocessors idle, and not.
@pytest.mark.parametrize(
    "n,k,bias", [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False)]
)
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_layers_match_the_reference_layers(mode, n, k, bias, dtype):
    from sidecar.model.kernels import triton_wo  # here: a CPU-only install may lack Triton

    layer, paths = _layer(mode, n, k, dtype, bias)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, k, generator=gen).to(dtype).cuda()
    with torch.inference_mode():
        ref = layer(x).float()
        paths.weight_only = True
        for rows in (1, 3, 16, 64):
            got = layer(x[:rows])
            assert got.dtype == dtype and got.shape == (rows, n)
            err = (got.float() - ref[:rows]).norm() / ref[:rows].norm()
            assert err < 1e-2, (rows, err.item())  # both round the activations and outputs to bf16
        assert torch.equal(layer(x[:1]), layer(x[:5])[:1])  # a row's result does not depend on its batch
    parts = triton_wo.splits(
        n,
        k,
        triton_wo._block_n(n),
        triton_wo.INT8_BLOCK_K,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )[0]
    assert (parts > 1) == (n <= 1152)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_products_survive_and_give_hf_tokens_at_batch_1(tiny_models, dtype):
    llm = LLM(model=str(tiny_models["qwen2"]), dtype=dtype, device="cuda", max_num_seqs=8, num_kv_blocks=128)
    info = llm.engine.model_info
    assert info["fast_path_fallbacks"] == {}, info["fast_path_fallbacks"]
    assert {"gemv", "cuda_graphs"} <= set(info["fast_paths"])
    prompts = make_prompts(3, 900, 3, 30, seed=9)
    got = [_greedy(llm, [p], 8)[0] for p in prompts]  # one at a time: the bucket-1 graph, products fused
    assert all(len(t) == 8 for t in got)
    if dtype == "float32":
        assert got == hf_greedy(tiny_models["qwen2"], prompts, 8)
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "n,k,bias", [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False)]
)
def test_fused_products_match_the_separate_kernels_at_real_shapes(n, k, bias):
    import torch.nn.functional as F

    from sidecar.model.kernels import triton_ops  # here: a CPU-only install may lack Triton
    from sidecar.model.kernels.triton import gemv as triton_gemv

    gen = torch.Generator().manual_seed(n + k)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    h, delta = torch.randn(1, k, generator=gen).to(**bf), torch.randn(1, k, generator=gen).to(**bf)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(**bf)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(**bf)
    b = torch.randn(n, generator=gen).to(**bf) if bias else None
    rel = lambda got, ref: float((got.float() - ref.float()).norm() / ref.float().norm())  # noqa: E731
    with torch.inference_mode():
        y, s = triton_gemv.norm_matmul(h, delta, nw, 1e-6, w, b)
        x, s_ref = triton_ops.add_rms_norm(h, delta, nw, 1e-6)
        assert torch.equal(s, s_ref) and rel(y, F.linear(x, w, b)) < 1e-2
        assert rel(triton_gemv.matmul(h, w, b), F.linear(h, w, b)) < 1e-2
        gu = torch.randn(1, 2 * k, generator=gen).to(**bf)
        assert rel(triton_gemv.silu_matmul(gu, w, b), F.linear(triton_ops.silu_mul(gu), w, b)) < 1e-2
