"""The grouped expert GEMM over MXFP4 codes (``triton_moe`` with scales): the same answer, bit for bit, as the
kernel on the weights dequantized first, in each dtype and activation, with biases; shapes it cannot take
refused; and a gpt-oss checkpoint that ships MXFP4 experts through the model with the path on against off."""

import pytest
import torch

from sidecar.config import EngineConfig
from sidecar.model import mxfp4
from sidecar.model.kernels.triton import moe as triton_moe
from sidecar.model.loader import load_model
from sidecar.model.moe import SparseMoE
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.kernels.triton.test_triton_moe import assert_moe_path_matches_off
from tests.unit.model.test_gpt_oss import to_mxfp4

H, INTER = 64, 96
LIMIT, ALPHA = 0.7, 1.702


def _codes(g, e, rows, cols, lo=118, hi=131):
    blocks = torch.randint(0, 256, (e, rows, cols // 2), generator=g).to(torch.uint8)
    scales = torch.randint(lo, hi, (e, rows, cols // 32), generator=g).to(torch.uint8)
    return blocks, scales


def _case(num_experts, k, t, bias, dtype, seed):
    """(x, weights, ids, experts as codes, the same experts dequantized to ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    gu, gu_s = _codes(g, num_experts, 2 * INTER, H)
    dn, dn_s = _codes(g, num_experts, H, INTER)
    if dtype == torch.float32:  # the smallest scale (2^-127, a subnormal float32) in one block of each
        gu_s[0, 0, 0] = dn_s[-1, 1, 1] = 0
    gu_b = torch.randn(num_experts, 2 * INTER, generator=g).to(dtype) if bias else None
    dn_b = torch.randn(num_experts, H, generator=g).to(dtype) if bias else None
    codes = triton_moe.Experts(gu, gu_b, dn, dn_b, gu_s, dn_s)

    def dense(blocks, scales):
        return mxfp4.dequantize(blocks.view(*scales.shape, 16), scales, dtype).contiguous()

    plain = triton_moe.Experts(dense(gu, gu_s), gu_b, dense(dn, dn_s), dn_b)
    x = torch.randn(t, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return x, weights, ids, codes, plain


@pytest.mark.parametrize("num_experts,k,t", [(4, 2, 1), (6, 3, 20), (5, 4, 3)])
@pytest.mark.parametrize("act", [triton_moe.SILU, triton_moe.CLAMPED_SWIGLU])
@pytest.mark.parametrize("bias", [False, True])
def test_codes_give_the_dequantized_weights_answer_bit_for_bit(num_experts, k, t, act, bias):
    x, weights, ids, codes, plain = _case(num_experts, k, t, bias, torch.float32, 7 * t + k + act)
    got = triton_moe.grouped_moe(x, weights, ids, codes, act, LIMIT, ALPHA)
    ref = triton_moe.grouped_moe(x, weights, ids, plain, act, LIMIT, ALPHA)
    assert got is not None and got.shape == x.shape and torch.isfinite(got).all()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codes_in_half_precision(dtype):
    x, weights, ids, codes, plain = _case(5, 2, 7, True, dtype, 3)
    got = triton_moe.grouped_moe(x, weights, ids, codes, triton_moe.CLAMPED_SWIGLU, LIMIT, ALPHA)
    ref = triton_moe.grouped_moe(x, weights, ids, plain, triton_moe.CLAMPED_SWIGLU, LIMIT, ALPHA)
    assert got.dtype == dtype and torch.equal(got, ref)


def test_codes_it_cannot_take_get_none():
    x, weights, ids, codes, _ = _case(4, 2, 3, False, torch.float32, 1)
    assert triton_moe.grouped_moe(x, weights, ids, codes._replace(down_scales=None)) is None
    assert (
        triton_moe.grouped_moe(x, weights, ids, codes._replace(down_scales=codes.down_scales[:, :, :1]))
        is None
    )
    as_int = codes._replace(gate_up=codes.gate_up.to(torch.int16))
    assert triton_moe.grouped_moe(x, weights, ids, as_int) is None
    # an intermediate width that is not a whole number of 32-column scale blocks
    g = torch.Generator().manual_seed(2)
    gu, gu_s = _codes(g, 4, 2 * 48, H)
    dn = torch.zeros(4, H, 24, dtype=torch.uint8)
    narrow = triton_moe.Experts(gu, None, dn, None, gu_s, torch.zeros(4, H, 1, dtype=torch.uint8))
    assert not triton_moe.takes(x, weights, ids, narrow)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("moe_mxfp4")
    return to_mxfp4(build_family_checkpoint("gpt_oss", root / "src", demo_dir), root / "mxfp4")


def test_gpt_oss_codes_through_the_model_with_the_moe_path_match_the_path_off(gpt_oss_mxfp4, monkeypatch):
    model = load_model(EngineConfig(model=str(gpt_oss_mxfp4), dtype="float32", device="cpu")).model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert blocks and all(b.stacked is not None and b.stacked.mxfp4 for b in blocks)
    assert all(isinstance(e.down_proj, mxfp4.Mxfp4Linear) for b in blocks for e in b.experts)
    assert_moe_path_matches_off(model, len(blocks), monkeypatch)
