"""Our fused CPU silu*mul and residual-add + RMSNorm against their torch references."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import cpu_build, norm_act

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}  # spacing relative to the value, at most


def _close(out, ref, dtype, ulps):
    """Within `ulps` units in the last place of the larger magnitude, element by element."""
    a, b = out.double(), ref.double()
    return bool(((a - b).abs() <= ulps * ULP[dtype] * torch.maximum(a.abs(), b.abs()) + 1e-30).all())


def test_kernel_builds_on_this_machine():
    assert norm_act.available(), cpu_build.reason("norm_act")


def _gate_up(rows, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * inter, generator=g) * 6
    gu[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # far tails (no overflow) and zero
    return gu.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 4864), (3, 37), (32, 1536), (300, 96)])
def test_silu_mul_matches_torch(rows, inter, dtype):
    gu = _gate_up(rows, inter, dtype, rows + inter)
    out = norm_act.silu_mul(gu)
    ref = norm_act.silu_mul_reference(gu)
    assert out.dtype == dtype and out.shape == (rows, inter)
    assert torch.isfinite(out).all()
    # Only the exp differs: float32 within a few ulps; bf16 rounds silu and the product as torch does,
    # so it can differ by one bf16 ulp where the float32 value sat on a rounding boundary.
    assert _close(out, ref, dtype, 8 if dtype == torch.float32 else 1)
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 896), (5, 100), (64, 576), (1024, 896)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(rows, dim, with_delta, dtype):
    g = torch.Generator().manual_seed(rows * dim)
    h = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, dim, generator=g).to(dtype) if with_delta else None
    w = torch.randn(dim, generator=g).to(dtype)
    h_before = h.clone()
    out, s = norm_act.add_rms_norm(h, delta, w, 1e-6)
    ref_out, ref_s = norm_act.add_rms_norm_reference(h, delta, w, 1e-6)
    assert torch.equal(h, h_before)  # the input stream is not written
    assert torch.equal(s, ref_s)  # the residual sum rounds exactly as torch's add
    assert out.dtype == dtype and out.shape == (rows, dim)
    # The mean of squares is summed in another order: float32 within a few ulps (times |w|), bf16 at
    # most one ulp of the normalised value and one of the product, and rarely.
    assert _close(out, ref_out, dtype, 8 if dtype == torch.float32 else 2)
    if dtype == torch.bfloat16:
        assert (out != ref_out).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1152), (3, 37), (17, 896)])
def test_add_bias_rounds_as_torch_add(rows, n, dtype):
    g = torch.Generator().manual_seed(rows + n)
    y = (torch.randn(rows, n, generator=g) * 4).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    b[:2] = torch.tensor([float("nan"), float("inf")])
    ref = y + b
    out = norm_act.add_bias(y, b)
    assert out.data_ptr() == y.data_ptr()  # in place
    assert torch.equal(
        out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[:, 2:],
        ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[:, 2:],
    )  # bit for bit
    assert out[:, 0].isnan().all() and (out[:, 1] == float("inf")).all()
    # another dtype for the bias, or rows not contiguous: torch's add, a new tensor
    b = torch.randn(n, generator=g).to(dtype)
    y2 = torch.randn(rows, n, generator=g).to(dtype)
    mixed = norm_act.add_bias(y2, b.double())
    assert mixed.data_ptr() != y2.data_ptr() and torch.equal(mixed, y2 + b.double())
    wide = torch.randn(max(rows, 2), 2 * n, generator=g).to(dtype)[:, :n]  # rows n apart: not contiguous
    out = norm_act.add_bias(wide, b)
    assert out.data_ptr() != wide.data_ptr() and torch.equal(out, wide + b)


def test_inputs_it_does_not_take_use_the_reference(monkeypatch):
    calls = []
    lib = norm_act._KERNEL.lib()
    monkeypatch.setattr(norm_act._KERNEL, "lib", lambda: calls.append(1) or lib)
    gu = torch.randn(4, 10, dtype=torch.float64)  # a dtype it does not take
    assert torch.equal(norm_act.silu_mul(gu), norm_act.silu_mul_reference(gu))
    h = torch.randn(3, 8)
    w = torch.randn(8)
    nc = torch.randn(8, 3).t()  # not contiguous
    out, s = norm_act.add_rms_norm(h, nc, w, 1e-5)
    ref, ref_s = norm_act.add_rms_norm_reference(h, nc, w, 1e-5)
    assert torch.equal(out, ref) and torch.equal(s, ref_s)
    assert calls  # they asked, and took the reference
    monkeypatch.setattr(
        norm_act._KERNEL, "lib", lambda: None
    )  # no kernel (no compiler, SIDECAR_CPU_KERNELS=0)
    gu = torch.randn(4, 10)
    assert torch.equal(norm_act.silu_mul(gu), norm_act.silu_mul_reference(gu))


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets_match_torch(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert norm_act.available(), cpu_build.reason("norm_act")
    for dtype in (torch.float32, torch.bfloat16):
        gu = _gate_up(9, 4864 + 3, dtype, 1)
        assert _close(
            norm_act.silu_mul(gu), norm_act.silu_mul_reference(gu), dtype, 8 if dtype == torch.float32 else 1
        )
        h, d, w = (torch.randn(7, 899).to(dtype), torch.randn(7, 899).to(dtype), torch.randn(899).to(dtype))
        out, s = norm_act.add_rms_norm(h, d, w, 1e-6)
        ref, ref_s = norm_act.add_rms_norm_reference(h, d, w, 1e-6)
        assert torch.equal(s, ref_s) and _close(out, ref, dtype, 8 if dtype == torch.float32 else 2)


def test_silu_has_the_same_bits_on_every_vector_width(monkeypatch):
    """silu's exp scales by 2^n in one instruction on AVX-512 and through the exponent's bits on AVX2: float32 silu * up
    must come out bit for bit the same from both builds, over gates from the far negative tail (where the exp is
    clamped) to large positives."""
    gate = torch.cat(
        [torch.linspace(-100.0, 30.0, 200_001), torch.tensor([-87.0, -86.99, -87.01, -0.0, 0.0, 1e-40])]
    )
    gu = torch.cat([gate, torch.ones_like(gate)])[None]
    native = norm_act.silu_mul(gu)
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert norm_act.available(), cpu_build.reason("norm_act")
    assert torch.equal(norm_act.silu_mul(gu), native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 16, 8, 128), (7, 4, 1, 256), (33, 3, 2, 20)])
def test_rms_norm_heads_in_place_is_the_row_norm_of_each_head(tokens, heads, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(tokens * heads + dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    wq, wk = torch.randn(dim, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype)
    before = qkv.clone()
    nq, nk = heads * dim, kv_heads * dim
    assert norm_act.rms_norm_heads_(qkv, 0, heads, dim, wq, 1e-6)
    assert norm_act.rms_norm_heads_(qkv, nq, kv_heads, dim, wk, 1e-6)
    # each head normed exactly as the row kernel norms it alone; v untouched
    q_ref = norm_act.add_rms_norm(before[:, :nq].reshape(-1, dim).contiguous(), None, wq, 1e-6)[0]
    k_ref = norm_act.add_rms_norm(before[:, nq : nq + nk].reshape(-1, dim).contiguous(), None, wk, 1e-6)[0]
    assert torch.equal(qkv[:, :nq].reshape(-1, dim), q_ref)
    assert torch.equal(qkv[:, nq : nq + nk].reshape(-1, dim), k_ref)
    assert torch.equal(qkv[:, nq + nk :], before[:, nq + nk :])
    # and within the reference's rounding (as the row kernel is held to above)
    ref = norm_act.add_rms_norm_reference(before[:, :nq].reshape(-1, dim), None, wq, 1e-6)[0]
    assert torch.allclose(
        q_ref.double(), ref.double(), rtol=2**-6 if dtype == torch.bfloat16 else 1e-5, atol=1e-6
    )


def test_rms_norm_heads_refuses_what_it_cannot_take():
    x = torch.randn(2, 64)
    before = x.clone()
    assert not norm_act.rms_norm_heads_(x, 40, 2, 16, torch.ones(16), 1e-6)  # past the row's end
    assert not norm_act.rms_norm_heads_(x, 0, 2, 16, torch.ones(16, dtype=torch.bfloat16), 1e-6)  # dtypes
    assert not norm_act.rms_norm_heads_(x.t(), 0, 2, 16, torch.ones(16), 1e-6)  # not contiguous
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 6912), (3, 37), (32, 1536)])
def test_gelu_tanh_mul_matches_torch(rows, inter, dtype):
    gu = _gate_up(rows, inter, dtype, rows * inter)
    out = norm_act.gelu_tanh_mul(gu)
    ref = norm_act.gelu_tanh_mul_reference(gu)
    assert out.dtype == dtype and out.shape == (rows, inter)
    assert torch.isfinite(out).all()
    # Only tanh differs (torch's 1 + tanh(u) cancelling in the negative tail is kept): float32 within a few ulps
    # of 1 + tanh(u) times the product's other factors; bf16 one ulp where float32 sat on a rounding boundary.
    gate, up = gu.float().chunk(2, dim=-1)
    scale = (0.5 * gate * up).abs().double()
    assert bool(((out.double() - ref.double()).abs() <= 8 * ULP[dtype] * (scale + ref.abs().double())).all())
    # Away from that tail (1 + tanh(u) above 2^-8) bf16 differs rarely.
    u = 0.7978845608028654 * (gate + 0.044715 * gate**3)
    body = (1 + torch.tanh(u)) > 2.0**-8
    if dtype == torch.bfloat16:
        assert (out != ref)[body].float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 2048), (3, 37), (20, 4100)])
def test_sigmoid_mul_matches_torch(rows, n, dtype):
    # a gated attention's output times sigmoid(gate): only the exp differs from torch's two ops
    xg = _gate_up(rows, n, dtype, rows + n)
    x, g = xg[:, n:].contiguous(), xg[:, :n].contiguous()
    out = norm_act.sigmoid_mul(x, g)
    ref = x * torch.sigmoid(g)
    assert out.dtype == dtype and out.shape == (rows, n) and torch.isfinite(out).all()
    assert _close(out, ref, dtype, 8 if dtype == torch.float32 else 1)
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 1e-3
    assert torch.equal(norm_act.sigmoid_mul(x, g[:, :1].expand(rows, n)), x * torch.sigmoid(g[:, :1]))
