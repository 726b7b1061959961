"""Weight-only int8/int4: stored-format round trips, fused-kernel linears vs dequantized references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sidecar.model.quant import (
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    quantize_linear,
    quantize_tied_embedding,
)
from sidecar.model.quant_format import (
    check_quant_args,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_round_trip_error_is_within_half_a_step_per_row():
    w = _weight(96, 200)
    original = w.clone()
    q, s = quantize_int8(w, torch.float32)
    assert torch.equal(w, original)  # quantizing never modifies the source weight
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (96,)
    assert q.abs().max() <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-7)
    # Every row uses the full code range (symmetric per-channel scale = absmax / 127).
    assert torch.all(q.abs().amax(dim=1) == 127)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_is_within_half_a_step_per_group(group_size):
    w = _weight(40, 256, seed=1)
    original = w.clone()
    q, s, z = quantize_int4(w, group_size, torch.float32)
    assert torch.equal(w, original)
    groups = 256 // group_size
    assert q.dtype == torch.uint8 and q.shape == (40, 128) and s.shape == (40, groups) == z.shape
    codes = unpack_int4(q)
    assert codes.max() <= 15
    deq = dequantize_int4(q, s, z, 256)
    step = s.repeat_interleave(group_size, dim=1)
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6)
    # Asymmetric: each group's min and max are representable (codes 0 and 15 both used).
    grouped = codes.reshape(40, groups, group_size)
    assert torch.all(grouped.amin(-1) == 0) and torch.all(grouped.amax(-1) == 15)


def test_int4_bf16_scales_are_the_ones_used_for_codes():
    w = _weight(16, 64, seed=2)
    q, s, z = quantize_int4(w, 32, torch.bfloat16)
    assert s.dtype == z.dtype == torch.bfloat16
    # Codes were computed from the rounded scales, so the error bound holds against them.
    deq = dequantize_int4(q, s, z, 64)
    assert torch.all((deq - w).abs() <= s.float().repeat_interleave(32, 1) * 0.5 + 1e-3)


def _reference(linear_w: torch.Tensor, bias, mode: str, group_size: int) -> torch.Tensor:
    if mode == "int8":
        return dequantize_int8(*quantize_int8(linear_w, linear_w.dtype))
    q, s, z = quantize_int4(linear_w, group_size, linear_w.dtype)
    return dequantize_int4(q, s, z, linear_w.shape[1])


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(64, 128), (50, 96), (7, 13), (33, 200), (130, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_quantized_linear_matches_dequantized_matmul(mode, n, k, dtype, lead):
    torch.manual_seed(n * 1000 + k)
    lin = nn.Linear(k, n, bias=True).to(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    deq = _reference(w, b, mode, 32)
    qlin = quantize_linear(lin, mode, 32)
    assert isinstance(qlin, Int8Linear if mode == "int8" else Int4Linear)
    assert lin.weight is None  # the full-precision weight is released
    x = torch.randn(*lead, k).to(dtype)
    y = qlin(x)
    assert y.shape == (*lead, n) and y.dtype == dtype
    ref = x.float() @ deq.T + b.float()
    # Activations run through the kernel in bf16: allow bf16 rounding of inputs and outputs.
    tol = 2e-2 * ref.abs().max().item() + 1e-3
    assert (y.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weights_and_scales_are_buffers_and_smaller(mode):
    lin = nn.Linear(256, 512, bias=False).to(torch.bfloat16)
    full_bytes = lin.weight.numel() * lin.weight.element_size()
    q = quantize_linear(lin, mode, 128)
    assert list(q.parameters()) == []
    names = {n for n, _ in q.named_buffers()}
    assert "weight" in names and ("scales" in names or "scales_and_zeros" in names)
    qbytes = sum(b.numel() * b.element_size() for b in q.buffers())
    assert qbytes <= full_bytes * (0.55 if mode == "int8" else 0.32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tied_embedding_lookup_matches_dequantized_rows(mode):
    torch.manual_seed(0)
    emb = nn.Embedding(100, 64)
    w = emb.weight.detach().clone()
    deq = _reference(w, None, mode, 32)
    qemb, head = quantize_tied_embedding(emb, mode, 32)
    assert isinstance(qemb, QuantEmbedding)
    ids = torch.tensor([[0, 5, 99], [7, 7, 1]])
    out = qemb(ids)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, deq[ids], rtol=0, atol=1e-6)
    x = torch.randn(4, 64)
    torch.testing.assert_close(head(x), x @ deq.T, rtol=0, atol=2e-2 * (x @ deq.T).abs().max().item())
    if mode == "int8":  # one table serves both
        assert qemb.qweight.data_ptr() == head.weight.data_ptr()


def test_bad_flags_name_the_field():
    with pytest.raises(ValueError, match="quantization"):
        check_quant_args("int3", 128)
    with pytest.raises(ValueError, match="quant_group_size"):
        check_quant_args("int4", 48)
    with pytest.raises(ValueError, match="quant_group_size: 128 does not divide in_features 96"):
        quantize_linear(nn.Linear(96, 32), "int4", 128)
    with pytest.raises(ValueError, match="quantization"):
        quantize_linear(nn.Linear(96, 32), "fp8", 128)


def test_config_validation_names_quantization_fields():
    from sidecar.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int2")
    with pytest.raises(ValueError, match="quant_group_size"):
        EngineConfig(quantization="int4", quant_group_size=100)
