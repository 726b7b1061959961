"""Our CPU int4 decode kernel against its float64 reference, torch's packed layout, and Int4Linear's use of it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import cpu_build, int4_gemv
from sidecar.model.quant import Int4Linear, _QuantLinearBase, quantize_linear
from sidecar.model.quant_format import dequantize_int4, quantize_int4, unpack_int4


def _bound(x, codes, gs, s, z, integer_dot):
    """Per-output bound on |kernel - float64 reference| for x [M, K], codes [N, K], scales and zeros [N, G]:
    float32 sums, plus (integer path) each activation rounded to 16 bits, by at most half its group's
    absmax / ACTIVATION_CODE_MAX, times |(code - 8) * scale|. Far inside the 2^-8 of bf16 activations."""
    x, s, z = x.double(), s.double(), z.double()
    n, k = codes.shape
    sw = (codes.double() - 8.0) * s.repeat_interleave(gs, dim=1)
    w = sw + z.repeat_interleave(gs, dim=1)
    bound = 1e-6 * (x.abs() @ w.abs().T) + 1e-30
    if integer_dot:
        step = x.abs().reshape(x.shape[0], -1, gs).amax(-1) / int4_gemv.ACTIVATION_CODE_MAX
        bound += 0.51 * step @ sw.abs().reshape(n, -1, gs).sum(-1).T
    return bound


def _case(m, n, k, gs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    codes = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(k // gs, n, generator=g) * 0.02 + 1e-3
    z = torch.randn(k // gs, n, generator=g) * 0.02
    return x, codes, torch.stack((s, z), dim=-1).bfloat16()


def _check(m, n, k, gs, layout=None, seed=0, dtype=torch.float32):
    x, codes, sz = _case(m, n, k, gs, seed)
    x = x.to(dtype).float()  # the values the kernel sees
    layout = layout or int4_gemv.torch_layout()
    y = int4_gemv.int4_matmul(x.to(dtype), int4_gemv.pack(codes, *layout), gs, sz, layout=layout)
    ref = int4_gemv.reference(x, codes, gs, sz)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    bound = _bound(x, codes, gs, sz[..., 0].T, sz[..., 1].T, int4_gemv.integer_dot())
    assert ((y.double() - ref.double()).abs() <= bound).all(), (m, n, k, gs, layout)
    # and far from the bf16 activations around torch's kernel
    assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_kernel_builds_on_this_machine():
    assert int4_gemv.available(), cpu_build.reason("int4_gemv")


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (64, 64), (80, 96), (112, 64), (208, 128), (4864, 896)])
def test_pack_writes_torchs_layout(n, k):
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(int4_gemv.pack(codes, *int4_gemv.torch_layout()), packed.reshape(n, -1))


def test_torch_avx2_layout_is_recognised_and_used():
    # torch packs in blocks of 32 rows when it runs its AVX2 code, 64 with AVX-512.
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from sidecar.model.kernels.cpu import int4_gemv
        from sidecar.model.quant import quantize_linear
        from sidecar.model.quant_format import dequantize_int4, quantize_int4
        assert int4_gemv.torch_layout() == (32, True), int4_gemv.torch_layout()
        torch.manual_seed(0)
        lin = nn.Linear(256, 208, bias=False)
        w = lin.weight.detach().clone()
        x = torch.randn(3, 256)
        q, s, z = quantize_int4(w, 64, w.dtype)  # the layer keeps scales and zeros in bf16
        ref = x.double() @ dequantize_int4(q, s.bfloat16(), z.bfloat16(), 256).double().T
        y = quantize_linear(lin, "int4", 64)(x)
        assert (y - ref).abs().max() <= 1e-4 * ref.abs().max(), (y - ref).abs().max()
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 17, 32])
@pytest.mark.parametrize("n,k,gs", [(64, 64, 32), (896, 896, 128), (208, 576, 32), (80, 1536, 64)])
def test_kernel_matches_reference(m, n, k, gs):
    _check(m, n, k, gs, seed=m * 31 + n)


@pytest.mark.parametrize("m,n,k,gs", [(40, 112, 256, 64), (70, 208, 2048, 128), (33, 4864, 896, 32)])
def test_prefill_sized_batches_match_reference(m, n, k, gs):
    # 32-row chunks of activations; the second case's activations outgrow the kernel's L2 budget,
    # which changes the order its work items go in
    _check(m, n, k, gs, seed=m)


@pytest.mark.parametrize("m,n,k,gs", [(1, 896, 896, 128), (5, 208, 576, 32), (40, 112, 256, 64)])
def test_bf16_activations_are_read_as_they_are(m, n, k, gs):
    _check(m, n, k, gs, seed=m, dtype=torch.bfloat16)


def _check_bf16_out(m, n, k, gs):
    x, codes, sz = _case(m, n, k, gs, seed=n)
    x[0, 3] = float("nan")
    x[-1] *= 1e37  # large exponents
    w = int4_gemv.pack(codes, *int4_gemv.torch_layout())
    y32 = int4_gemv.int4_matmul(x, w, gs, sz)
    y16 = int4_gemv.int4_matmul(x, w, gs, sz, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and y16.shape == (m, n)
    want = y32.to(torch.bfloat16)
    assert torch.equal(y16.isnan(), want.isnan()) and y16.isnan()[0].all()
    assert torch.equal(y16.nan_to_num(0.0), want.nan_to_num(0.0))  # rounded to nearest even, as torch does


@pytest.mark.parametrize("m,n,k,gs", [(3, 208, 576, 32), (33, 896, 896, 128)])
def test_bf16_output_is_the_float_output_rounded(m, n, k, gs):
    _check_bf16_out(m, n, k, gs)


def test_no_rows():
    x, codes, sz = _case(1, 64, 64, 32)
    y = int4_gemv.int4_matmul(x[:0], int4_gemv.pack(codes, *int4_gemv.torch_layout()), 32, sz)
    assert y.shape == (0, 64)


@pytest.mark.parametrize("layout", int4_gemv.LAYOUTS)
@pytest.mark.parametrize(
    "m,n,k,gs",
    [(1, 112, 128, 32), (5, 176, 256, 64), (33, 48, 64, 32), (3, 4864, 896, 128), (2, 896, 4864, 128)],
)
def test_every_layout_matches_reference(layout, m, n, k, gs):
    _check(m, n, k, gs, layout, seed=m + k)


def _check_rows_alone(layout):
    """Each output row bit for bit as the row alone gives it: calls of 1-2 rows and of more rows take different
    loops (with AVX2: bytes of the activation codes against pairs of codes, or the 16-bit codes against codes
    decoded once for every row), the same exact integer sums and the same float steps after them."""
    for m, n, k, gs in [
        (3, 112, 128, 32),
        (4, 176, 576, 64),
        (7, 896, 896, 128),
        (33, 80, 96, 32),
        (70, 64, 512, 256),
        (5, 48, 256, 16),
    ]:
        x, codes, sz = _case(m, n, k, gs, seed=m + n)
        x[1] *= 1e3  # rows of very different sizes: each has its own code scale per group
        x[2, :gs] = 0.0  # and a group of zeros (code scale 0)
        w = int4_gemv.pack(codes, *layout)
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            y = int4_gemv.int4_matmul(xs, w, gs, sz, layout=layout)
            alone = torch.cat(
                [int4_gemv.int4_matmul(xs[i : i + 1], w, gs, sz, layout=layout) for i in range(m)]
            )
            assert torch.equal(y, alone), (layout, m, n, k, gs, dtype, (y - alone).abs().max())
            pairs = torch.cat(
                [int4_gemv.int4_matmul(xs[i : i + 2], w, gs, sz, layout=layout) for i in range(0, m, 2)]
            )
            assert torch.equal(y, pairs), (layout, m, n, k, gs, dtype)


@pytest.mark.parametrize("layout", int4_gemv.LAYOUTS)
def test_a_rows_outputs_do_not_depend_on_its_batch(layout):
    _check_rows_alone(layout)


def test_avx2_build_matches_reference(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")  # no AVX-512, as on Zen 2
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert int4_gemv.vector_bits() == 256, cpu_build.reason("int4_gemv")
    assert int4_gemv.integer_dot()  # 16-bit activations and exact integer sums (vpmaddubsw), as with VNNI
    for layout in int4_gemv.LAYOUTS:
        for m, n, k, gs in [
            (1, 112, 128, 32),
            (3, 176, 576, 64),
            (8, 896, 896, 128),
            (17, 80, 96, 32),
            (2, 64, 512, 256),
            (1, 48, 256, 16),
        ]:
            _check(m, n, k, gs, layout, seed=m + n)
    _check(5, 208, 576, 32, dtype=torch.bfloat16)
    _check_bf16_out(3, 208, 576, 32)
    for layout in int4_gemv.LAYOUTS:
        _check_rows_alone(layout)


def _check_panels():
    """Calls of 2-9 rows (a decode step verifying a speculative draft) go in panels of up to 3 rows over codes
    decoded once a group: 3, 2 + 2, 3 + 2, 3 + 3, 3 + 2 + 2, 3 + 3 + 2 and 3 + 3 + 3; 2 rows of split blocks of
    32 decode each column pair in registers (fused_group). Each row bit for bit as the row alone gives it (the
    one-row loop reads the codes another way: the same exact integer sums and float steps), with 16-row tail
    blocks and group sizes of 16 (a single unrolled step of column pairs), 48, 96 and 256, rows of very
    different sizes and a group of zeros; and within the reference's bound."""
    for m in range(2, 10):
        for n, k, gs in [(80, 96, 16), (208, 576, 32), (112, 144, 48), (48, 192, 96), (176, 512, 256)]:
            x, codes, sz = _case(m, n, k, gs, seed=7 * m + n)
            x[m - 1] *= 1e3
            x[0, k - gs :] = 0.0
            ref = int4_gemv.reference(x, codes, gs, sz).double()
            bound = _bound(x, codes, gs, sz[..., 0].T, sz[..., 1].T, int4_gemv.integer_dot())
            for layout in int4_gemv.LAYOUTS:
                w = int4_gemv.pack(codes, *layout)
                for dtype in (torch.float32, torch.bfloat16):
                    xs = x.to(dtype)
                    y = int4_gemv.int4_matmul(xs, w, gs, sz, layout=layout)
                    alone = torch.cat(
                        [int4_gemv.int4_matmul(xs[i : i + 1], w, gs, sz, layout=layout) for i in range(m)]
                    )
                    assert torch.equal(y, alone), (m, n, k, gs, layout, dtype, (y - alone).abs().max())
                    if dtype is torch.float32:
                        assert ((y.double() - ref).abs() <= bound).all(), (m, n, k, gs, layout)


def _check_layouts_agree():
    """The same codes in every layout give the same bits, for 1-8 rows: whichever loop a layout and a row
    count take (split blocks of 32 rows read four columns at a time, other blocks two), the integer sums are
    exact and the float steps after them the same. Tail blocks (n % 32), group sizes that are not a multiple
    of 32, rows of very different sizes and a group of zeros; each also within the reference's bound."""
    for m, n, k, gs in [
        (1, 48, 48, 16),
        (2, 80, 144, 48),
        (1, 208, 576, 64),
        (2, 96, 1024, 128),
        (1, 112, 512, 256),
        (3, 176, 160, 32),
        (8, 48, 96, 96),
    ]:
        x, codes, sz = _case(m, n, k, gs, seed=m * n + k)
        x[0, :gs] *= 1e3
        x[m - 1, k - gs :] = 0.0
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            ys = [
                int4_gemv.int4_matmul(xs, int4_gemv.pack(codes, *lay), gs, sz, layout=lay)
                for lay in int4_gemv.LAYOUTS
            ]
            for lay, y in zip(int4_gemv.LAYOUTS[1:], ys[1:]):
                assert torch.equal(y, ys[0]), (m, n, k, gs, lay, dtype, (y - ys[0]).abs().max())
            ref = int4_gemv.reference(xs.float(), codes, gs, sz).double()
            bound = _bound(xs.float(), codes, gs, sz[..., 0].T, sz[..., 1].T, int4_gemv.integer_dot())
            assert ((ys[0].double() - ref).abs() <= bound).all(), (m, n, k, gs, dtype)


def test_panels_of_two_to_seven_rows_give_each_rows_bits():
    _check_panels()


def test_panels_give_each_rows_bits_in_the_avx2_build(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")  # no AVX-512, as on Zen 2 and Zen 3
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert int4_gemv.vector_bits() == 256 and int4_gemv.integer_dot(), cpu_build.reason("int4_gemv")
    _check_panels()


def test_every_layout_gives_the_same_bits():
    _check_layouts_agree()


def test_every_layout_gives_the_same_bits_in_the_avx2_build(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")  # no AVX-512, as on Zen 2 and Zen 3
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert int4_gemv.vector_bits() == 256 and int4_gemv.integer_dot(), cpu_build.reason("int4_gemv")
    _check_layouts_agree()


def test_non_finite_activations_give_non_finite_rows():
    x, codes, sz = _case(3, 64, 64, 32)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    y = int4_gemv.int4_matmul(x, int4_gemv.pack(codes, *int4_gemv.torch_layout()), 32, sz)
    assert torch.isfinite(y[0]).all()
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).any()  # never a silently finite answer


def test_shape_mismatch_is_refused():
    x, codes, sz = _case(1, 64, 64, 32)
    w = int4_gemv.pack(codes, *int4_gemv.torch_layout())
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemv.int4_matmul(x[:, :32], w, 32, sz)
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemv.int4_matmul(x, w, 32, sz.half())


@pytest.mark.parametrize("rows", [1, 3, 5, int4_gemv.MAX_ROWS, int4_gemv.MAX_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("features,gs", [((200, 70), 32), ((896, 128), 128), ((576, 1536), 64)])
def test_int4_linear_matches_the_dequantized_layer(rows, dtype, features, gs, monkeypatch):
    calls = []
    real = int4_gemv.int4_matmul
    monkeypatch.setattr(int4_gemv, "int4_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(rows)
    k, n = features  # 200 is padded to 224 columns, 70 to 80 rows (a 16-row tail block)
    lin = nn.Linear(k, n, bias=True).to(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    q, s, z = quantize_int4(w, gs, w.dtype)
    s, z = s.bfloat16(), z.bfloat16()  # the layer keeps scales and zeros in bf16
    deq = dequantize_int4(q, s, z, k)
    qlin = quantize_linear(lin, "int4", gs)
    assert isinstance(qlin, Int4Linear)
    x = torch.randn(rows, k).to(dtype)
    y = qlin(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    # decode-sized batches take our kernels, and bf16 batches of any size where AMX multiplies the codes (of layers
    # whose inputs need no padding: 896)
    assert bool(calls) == (
        rows <= int4_gemv.MAX_ROWS or int4_gemv.tiles_take(gs, k, dtype) and k == qlin.k_padded
    )
    ref = x.double() @ deq.double().T + b.double()
    if dtype == torch.float32 and calls:
        xp = F.pad(x, (0, q.shape[1] * 2 - k))  # the layer pads in_features to whole groups
        assert (
            (y.double() - ref).abs() <= _bound(xp, unpack_int4(q), gs, s, z, int4_gemv.integer_dot())
        ).all()
    else:  # bf16 output, or torch's kernel with bf16 activations
        assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_switched_off_kernel_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    assert not int4_gemv.available()
    assert "SIDECAR_CPU_KERNELS" in cpu_build.reason("int4_gemv")
    lin = nn.Linear(64, 32)
    w = lin.weight.detach().clone()
    qlin = quantize_linear(lin, "int4", 32)
    x = torch.randn(1, 64)
    ref = x @ dequantize_int4(*quantize_int4(w, 32, w.dtype), 64).T + qlin.bias
    assert (qlin(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_a_checked_layer_gives_the_calls_bits_and_follows_its_buffers():
    """int4_gemv.Layer (operands checked once, as Int4Linear holds them) computes what int4_matmul computes,
    and an Int4Linear whose buffers are replaced builds a new one instead of reading the old tensors."""
    torch.manual_seed(3)
    lin = nn.Linear(256, 96, bias=True).bfloat16()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    q = quantize_linear(lin, "int4", 64)
    x = torch.randn(3, 256).bfloat16()
    layer = int4_gemv.Layer(q.weight, q.group_size, q.scales_and_zeros)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(
            layer(x, out), int4_gemv.int4_matmul(x, q.weight, q.group_size, q.scales_and_zeros, out_dtype=out)
        )
    assert torch.equal(
        layer(x.float()[:, ::1], torch.float32),
        int4_gemv.int4_matmul(x.float(), q.weight, 64, q.scales_and_zeros),
    )
    with pytest.raises(ValueError, match="256 inputs"):
        layer(torch.randn(2, 128), torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemv.Layer(q.weight[:, :64], 64, q.scales_and_zeros)
    y = q(x)  # the checked layer's path: the same bits as the general path through int4_matmul
    assert torch.equal(y, _QuantLinearBase.forward(q, x))
    ref = F.linear(x.float(), w.float(), b.float())
    assert (y.float() - ref).abs().max() <= 0.1 * ref.abs().max()  # int4 weights
    first = q._cpu_layer
    assert first is not None and first.matches(q.weight, q.scales_and_zeros)
    q.scales_and_zeros = q.scales_and_zeros * 2  # a new buffer: the layer is rebuilt around it
    y2 = q(x)
    assert q._cpu_layer is not first and q._cpu_layer.sz is q.scales_and_zeros
    assert (y2.float() - y.float()).abs().max() > 0
    twin = copy.deepcopy(
        q
    )  # a copy drops the view (it holds a C function) and builds its own over its buffers
    assert twin._cpu_layer is None and torch.equal(twin(x), y2) and twin._cpu_layer.weight is twin.weight
