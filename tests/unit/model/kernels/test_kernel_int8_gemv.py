"""Our CPU int8 decode kernel against its torch reference, and Int8Linear's use of it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sidecar.model.kernels.cpu import amx_gemm, bf16_gemv, cpu_build, int8_gemm, int8_gemv
from sidecar.model.quant import Int8Linear, quantize_linear
from sidecar.model.quant_format import dequantize_int8, quantize_int8


def _case(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # the whole int8 range
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    return x, w, s


def test_kernel_builds_on_this_machine():
    assert int8_gemv.available(), cpu_build.reason("int8_gemv")


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 7, 13),
        (1, 896, 4864),
        (2, 50, 96),
        (3, 130, 200),
        (4, 33, 64),
        (1, 5, 31),
        (2, 9, 65),
        (5, 40, 96),
        (9, 17, 130),
        (32, 64, 896),
    ],
)
def test_kernel_matches_reference(m, n, k):
    x, w, s = _case(m, n, k, seed=m * 7 + k)
    y = int8_gemv.int8_matmul(x, w, s)
    ref = int8_gemv.reference(x, w, s)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # int16 activations: error relative to the largest output stays near 2^-15, far inside bf16's 2^-8.
    assert (y - ref).abs().max() <= 2e-4 * ref.abs().max()


def test_worst_case_sums_do_not_overflow():
    k = 20000  # every product at its maximum: lanes stay in int32, the dot product needs int64
    x = torch.full((1, k), 3.0)
    w = torch.full((3, k), 127, dtype=torch.int8)
    w[1], w[2] = -127, -128  # -128: the code a symmetric 8-bit checkpoint's rounding reaches
    y = int8_gemv.int8_matmul(x, w, torch.ones(3))
    assert torch.allclose(y, torch.tensor([[3.0 * 127 * k, -3.0 * 127 * k, -3.0 * 128 * k]]), rtol=1e-5)


def test_zero_and_non_finite_rows():
    x, w, s = _case(3, 6, 64)
    x[0] = 0.0
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    y = int8_gemv.int8_matmul(x, w, s)
    assert torch.equal(y[0], torch.zeros(6))
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()  # never a silently finite answer


def test_shape_mismatch_is_refused():
    x, w, s = _case(1, 4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemv.int8_matmul(x, w[:, :16], s)


@pytest.mark.parametrize("rows", [1, 3, int8_gemv.MAX_ROWS, int8_gemv.MAX_ROWS + 1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features", [200, 256])  # 200 is padded to 224 columns; 256 is taken as it is
def test_int8_linear_few_and_many_rows_match_the_dequantized_layer(rows, dtype, features, monkeypatch):
    calls = []
    for name in ("int8_matmul", "int8_linear"):
        monkeypatch.setattr(
            int8_gemv, name, lambda *a, real=getattr(int8_gemv, name), **k: calls.append(1) or real(*a, **k)
        )
    real_call = int8_gemv.Layer.__call__
    monkeypatch.setattr(int8_gemv.Layer, "__call__", lambda *a: calls.append(1) or real_call(*a))
    torch.manual_seed(rows)
    lin = nn.Linear(features, 70, bias=True).to(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    deq = dequantize_int8(*quantize_int8(w, w.dtype))
    qlin = quantize_linear(lin, "int8")
    x = torch.randn(rows, features).to(dtype)
    y = qlin(x)
    assert y.dtype == dtype and y.shape == (rows, 70)
    # decode-sized batches take our kernel, larger ones too where the AVX2 path over the codes is built, or AMX's for
    # bf16 (whole 32-value chunks: 200 features' activations are zero-padded to the codes' 224 columns first)
    assert bool(calls) == (
        rows <= int8_gemv.MAX_ROWS
        or int8_gemm.available()
        or dtype == torch.bfloat16
        and amx_gemm.available()
    )
    ref = x.float() @ deq.float().T + b.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "x_dtype,out_dtype,bias_dtype",
    [
        (torch.float32, torch.float32, None),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16, None),
    ],
)
def test_one_call_layer_is_the_separate_steps_rounded_once(grouped, x_dtype, out_dtype, bias_dtype):
    """int8_linear reads bf16 activations as they are, adds the bias and rounds a bf16 result once: the same bits
    as the float32 kernel call, a float32 bias add and one cast."""
    for m, n, k in ((1, 37, 96), (5, 130, 896), (32, 64, 4864)):
        x, w, s = _case_g32(m, n, k, seed=m) if grouped else _case(m, n, k, seed=m)
        x = x.to(x_dtype)
        bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
        y = int8_gemv.int8_linear(x, w, s, bias, out_dtype, grouped=grouped)
        # the same call on operands checked once (what Int8Linear holds); with AMX, bf16 batches of TILE_MIN_ROWS
        # rows or more go to the tile path
        layer = int8_gemv.Layer(w, s, bias, grouped)
        tiles = layer.amx and x_dtype is torch.bfloat16 and m >= layer.from_rows
        assert torch.equal(
            layer(x, out_dtype), amx_gemm.int8_matmul(x, w, s, bias, out_dtype) if tiles else y
        )
        ref = (int8_gemv.int8_g32_matmul if grouped else int8_gemv.int8_matmul)(x.float(), w, s)
        if bias is not None:
            ref = ref + bias.float()
        assert y.dtype == out_dtype and torch.equal(y, ref.to(out_dtype))


def test_one_call_layer_refuses_what_does_not_fit():
    x, w, s = _case(2, 8, 64)
    for bad in (
        dict(x=x.half()),
        dict(scales=s.bfloat16()),
        dict(bias=torch.zeros(7)),
        dict(out_dtype=torch.half),
        dict(scales=torch.ones(8, 2), grouped=False),
        dict(x=x[:, :40], w=w[:, :40], grouped=True),
    ):
        args = dict(x=x, w=w, scales=s, bias=None, out_dtype=torch.float32, grouped=False) | bad
        with pytest.raises(ValueError, match="do not fit"):
            int8_gemv.int8_linear(
                args["x"], args["w"], args["scales"], args["bias"], args["out_dtype"], grouped=args["grouped"]
            )


def test_switched_off_kernel_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    assert not int8_gemv.available()
    assert "SIDECAR_CPU_KERNELS" in cpu_build.reason("int8_gemv")
    lin = nn.Linear(64, 32)
    w = lin.weight.detach().clone()
    qlin = quantize_linear(lin, "int8")
    assert isinstance(qlin, Int8Linear)
    x = torch.randn(1, 64)
    ref = x @ dequantize_int8(*quantize_int8(w, w.dtype)).T + qlin.bias
    assert (qlin(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    assert cpu_build.load("int8_gemv") is None
    assert "no C compiler" in cpu_build.reason("int8_gemv")


def _case_g32(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4
    return x, w, d


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 7, 32),
        (1, 4864, 896),
        (2, 50, 96),
        (3, 130, 576),
        (4, 33, 64),
        (5, 40, 96),
        (9, 17, 1536),
        (32, 64, 896),
    ],
)
def test_grouped_kernel_matches_reference(m, n, k):
    x, w, d = _case_g32(m, n, k, seed=m * 5 + k)
    y = int8_gemv.int8_g32_matmul(x, w, d)
    ref = int8_gemv.reference_g32(x, w, d)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y - ref).abs().max() <= 2e-4 * ref.abs().max()
    # Scales really are per group: scaling one group of one row changes that output alone.
    d2 = d.clone()
    d2[0, -1] *= 3
    y2 = int8_gemv.int8_g32_matmul(x, w, d2)
    assert torch.equal(y2[:, 1:], y[:, 1:])
    assert torch.allclose(y2[:, 0], int8_gemv.reference_g32(x, w, d2)[:, 0], rtol=1e-3, atol=1e-3)


def test_grouped_kernel_refuses_shapes_and_keeps_non_finite_rows():
    x, w, d = _case_g32(3, 6, 64)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemv.int8_g32_matmul(x[:, :48], w[:, :48], d[:, :1])
    x[1, 5] = float("nan")
    x[2] = 0.0
    y = int8_gemv.int8_g32_matmul(x, w, d)
    assert torch.isnan(y[1]).all() and torch.equal(y[2], torch.zeros(6))


@pytest.mark.parametrize("grouped", [False, True])
def test_a_rows_result_is_the_same_in_any_batch(grouped):
    # Speculative verification and beams batch rows that plain decode runs one at a time: every row of an
    # M-row product (tiles of several rows, weight-row tails) equals that row's product alone, bit for bit.
    x, w, s = _case_g32(9, 37, 320, seed=3) if grouped else _case(9, 37, 333, seed=3)
    run = int8_gemv.int8_g32_matmul if grouped else int8_gemv.int8_matmul
    alone = torch.cat([run(x[i : i + 1], w, s) for i in range(9)])
    for m in range(2, 10):
        assert torch.equal(run(x[:m], w, s), alone[:m])


@pytest.mark.parametrize("rows", [1, 4, int8_gemv.MAX_ROWS, int8_gemv.MAX_ROWS + 7])
@pytest.mark.parametrize("kernels", [True, False])
def test_q8_0_lm_head_and_embedding_match_the_dequantized_table(rows, kernels, monkeypatch):
    from sidecar.model import q8_0

    if not kernels:
        monkeypatch.setattr(int8_gemv, "available", lambda: False)
    monkeypatch.setattr(q8_0, "CHUNK_ROWS", 64)  # several chunks on the dequantizing path
    _, w, d = _case_g32(1, 300, 96, seed=rows)
    emb, head = q8_0.tied_q8_0_modules(w, d, torch.float32)
    table = int8_gemv.dequantize_g32(w, d)
    x = torch.randn(rows, 96)
    ref = x.double() @ table.double().T
    y = head(x)
    assert y.shape == (rows, 300) and y.dtype == torch.float32
    assert (y - ref).abs().max() <= 2e-4 * ref.abs().max()
    ids = torch.randint(0, 300, (2, 5))
    assert torch.equal(emb(ids), table[ids])


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets_match_reference(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert int8_gemv.available(), cpu_build.reason("int8_gemv")
    for m, n, k in [(1, 7, 13), (3, 130, 200), (5, 41, 96), (9, 17, 1536), (16, 33, 4864), (2, 9, 65)]:
        x, w, s = _case(m, n, k, seed=m + k)
        ref = int8_gemv.reference(x, w, s)
        assert (int8_gemv.int8_matmul(x, w, s) - ref).abs().max() <= 2e-4 * ref.abs().max()
        xb = x.bfloat16()
        assert torch.equal(
            int8_gemv.int8_linear(xb, w, s, None, torch.bfloat16),
            int8_gemv.int8_matmul(xb.float(), w, s).bfloat16(),
        )
        if k % 32 == 0:
            x, w, d = _case_g32(m, n, k, seed=m + k)
            ref = int8_gemv.reference_g32(x, w, d)
            assert (int8_gemv.int8_g32_matmul(x, w, d) - ref).abs().max() <= 2e-4 * ref.abs().max()
    test_worst_case_sums_do_not_overflow()


def test_int8_layer_follows_replaced_buffers_and_refuses_bad_activations():
    torch.manual_seed(0)
    qlin = quantize_linear(nn.Linear(96, 40, bias=True), "int8")
    x = torch.randn(2, 96)
    y = qlin(x)
    first = qlin._cpu_layer
    assert first is not None and first.matches(qlin.weight, qlin.scales_f32, qlin.bias)
    qlin.bias = qlin.bias + 1  # a new buffer: the checked layer is rebuilt around it, never reads the old one
    assert torch.allclose(qlin(x), y + 1, atol=1e-5) and qlin._cpu_layer is not first
    with pytest.raises(ValueError, match="96 float32 or bf16 inputs"):
        qlin._cpu_layer(torch.randn(2, 64), torch.float32)
    with pytest.raises(ValueError, match="96 float32 or bf16 inputs"):
        qlin._cpu_layer(x.half(), torch.float32)
    twin = copy.deepcopy(qlin)  # the copy drops the view (a C function) and builds its own over its buffers
    assert twin._cpu_layer is None and torch.equal(twin(x), qlin(x)) and twin._cpu_layer.weight is twin.weight


@pytest.fixture
def avx2_build(monkeypatch):
    """The kernels built for AVX2 + FMA (as on a Zen 2/3), whatever this CPU has beyond."""
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert int8_gemm.available(), cpu_build.reason("int8_gemm")
    assert int8_gemv.takes(int8_gemv.MAX_ROWS + 1)


# past MAX_ROWS, and fewer (the path takes any batch: panels of 1 to 6 rows); a padded last group of 16 weight
# rows (7, 130 rows), two passes over K (1,056), three row chunks of 2 MiB (220 x 4,864)
WIDE_CASES = [(3, 40, 96), (33, 7, 64), (40, 130, 1056), (64, 96, 896), (220, 40, 4864)]


@pytest.mark.parametrize("m,n,k", WIDE_CASES)
def test_wide_path_is_the_bf16_prefill_kernel_over_the_codes(m, n, k, avx2_build):
    """Prefill batches over int8 codes: the bf16 kernel's sums over the codes as bf16 weights (exact: small
    integers), bit for bit (here the plain-rows kernel's, another arrangement of the same order), then times the
    row's scale, plus the bias, rounded once."""
    x, w, s = _case(m, n, k, seed=m + n)
    xb = x.bfloat16()
    sums = bf16_gemv.bf16_matmul(xb, w.bfloat16())
    assert torch.equal(int8_gemm.int8_matmul_wide(xb, w, torch.ones(n)), sums)
    for bias in (None, torch.randn(n), torch.randn(n).bfloat16()):
        for out in (torch.float32, torch.bfloat16):
            y = int8_gemm.int8_matmul_wide(xb, w, s, bias, out)
            ref = sums * s if bias is None else sums * s + bias.float()
            assert y.dtype == out and torch.equal(y, ref.to(out))


@pytest.mark.parametrize("m,n,k", WIDE_CASES)
def test_wide_path_reads_float32_activations_as_they_are(m, n, k, avx2_build):
    x, w, s = _case(m, n, k, seed=m * 3 + k)
    y = int8_gemm.int8_matmul_wide(x, w, s)
    ref = int8_gemv.reference(x, w, s)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()  # float32 sums of exact products
    # a row's result does not depend on the batch it came in
    assert torch.equal(int8_gemm.int8_matmul_wide(x[2:3].expand(m, k).contiguous(), w, s)[m - 1], y[2])
    for bad in (x.half(), x[:, : k - 32], x[0]):
        with pytest.raises(ValueError, match="int8_matmul_wide"):
            int8_gemm.int8_matmul_wide(bad, w, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layer_prefill_takes_the_wide_path(dtype, avx2_build, monkeypatch):
    calls = []
    real = int8_gemm.int8_matmul_wide
    monkeypatch.setattr(int8_gemm, "int8_matmul_wide", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(1)
    lin = nn.Linear(896, 150, bias=True).to(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    qlin = quantize_linear(lin, "int8")
    x = torch.randn(2, 50, 896).to(dtype)
    y = qlin(x)
    assert calls == [100] and y.dtype == dtype and y.shape == (2, 50, 150)
    ref = real(x.reshape(100, 896), qlin.weight, qlin.scales_f32, qlin.bias, dtype).reshape(2, 50, 150)
    assert torch.equal(y, ref)
    deq = dequantize_int8(*quantize_int8(w, w.dtype))
    close = x.float() @ deq.float().T + b.float()
    assert (y.float() - close).abs().max() <= 1e-2 * close.abs().max()


# past MAX_ROWS: a single pass (33, 64 rows), k blocks (65+), blocks of rows (1,100 x 96), slabs of chunks (300 x
# 4,864), a partial last group of weight rows (45, 130), output past 8 MiB streamed (600 x 4,000)
AMX_CASES = [(33, 45, 96), (64, 130, 896), (65, 64, 4864), (300, 96, 4864), (1100, 70, 96), (600, 4000, 896)]


@pytest.mark.parametrize("m,n,k", AMX_CASES)
def test_amx_path_is_the_bf16_tile_product_over_the_codes(m, n, k, tile_build):
    """Prefill batches over int8 codes on a CPU with AMX or AVX-512 BF16 (the build for this CPU, and one without AMX):
    the bf16 tile-layout kernel's sums over the codes as bf16 weights (exact: small integers), bit for bit, then times
    the row's scale, plus the bias, rounded once; a row alone gives its bits in the batch. Without either the path
    says so (None) and the layer keeps its other paths."""
    x, w, s = _case(m, n, k, seed=m + n)
    xb = x.bfloat16()
    assert amx_gemm.available() == bool(tile_build), amx_gemm.reason()
    if not tile_build:
        assert amx_gemm.int8_matmul(xb, w, s) is None
        return
    sums = amx_gemm.AmxLayer(amx_gemm.pack(w.bfloat16()), n, None)(xb, torch.float32)
    assert torch.equal(amx_gemm.int8_matmul(xb, w, torch.ones(n)), sums)
    exact = (xb.double() @ w.double().T) * s.double()
    for bias in (None, torch.randn(n), torch.randn(n).bfloat16()):
        for out in (torch.float32, torch.bfloat16):
            y = amx_gemm.int8_matmul(xb, w, s, bias, out)
            ref = sums * s if bias is None else sums * s + bias.float()
            assert y.dtype == out and torch.equal(y, ref.to(out))
    y = amx_gemm.int8_matmul(xb, w, s)
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert torch.equal(amx_gemm.int8_matmul(xb[m // 2 : m // 2 + 1], w, s), y[m // 2 : m // 2 + 1])


def test_int8_layer_prefill_takes_the_amx_path_for_bf16(monkeypatch):
    """An int8 layer's bf16 prefill batch goes through the tile-layout path where it runs (AMX or AVX-512 BF16: the
    dequantized layer's values), with AMX from TILE_MIN_ROWS rows (decode batches too); float32 activations keep the
    layer's other paths."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True).bfloat16()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    deq = dequantize_int8(*quantize_int8(w, w.dtype))
    qlin = quantize_linear(lin, "int8")
    calls = []
    real = amx_gemm.int8_matmul
    monkeypatch.setattr(amx_gemm, "int8_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    amx = amx_gemm.available() and amx_gemm.path() == "AMX"
    for rows in (100, int8_gemv.MAX_ROWS, int8_gemv.TILE_MIN_ROWS, int8_gemv.TILE_MIN_ROWS - 1):
        calls.clear()
        x = torch.randn(rows, 256).bfloat16()
        y = qlin(x)
        tiles = amx_gemm.available() and (
            rows > int8_gemv.MAX_ROWS or amx and rows >= int8_gemv.TILE_MIN_ROWS
        )
        assert calls == ([rows] if tiles else []), rows
        ref = x.float() @ deq.float().T + b.float()
        assert y.dtype == torch.bfloat16 and (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
        if tiles:  # the tile path's bits: a row's result the same in a batch of any size that takes it
            assert torch.equal(qlin(torch.cat([x, x[:1]])), torch.cat([y, y[:1]]))
    calls.clear()
    qlin(torch.randn(20, 256))
    assert calls == []
