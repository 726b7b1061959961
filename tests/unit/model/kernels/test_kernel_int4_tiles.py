"""int4 layers on a CPU with AMX: tile products over the codes widened to bf16 (``amx_gemm.c``), against the float64
reference in every torch layout, a row's bits whatever its batch, the layer's choice between this path and the int4
kernel, and the start-up check. Each test runs in the build for this CPU and in one with AMX left out (the
``tile_build`` fixture), where the path must be off and every batch stay on the int4 kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sidecar.model.kernels.cpu import int4_gemv
from sidecar.model.quant import quantize_linear


@pytest.fixture
def tiles(tile_build, monkeypatch) -> bool:
    """Whether the tile path runs in this build: on with AMX, off (with its reason) otherwise."""
    monkeypatch.setattr(int4_gemv, "_tiles", {})
    on = int4_gemv.tiles_available()
    assert on == (tile_build == "AMX"), int4_gemv._tiles
    if not on:
        why = int4_gemv._tiles["reason"]
        assert "no AMX" in why if int4_gemv.available() else "not available" in why, why
        assert not int4_gemv.tiles_take(128, 256)
    return on


def _case(m, n, k, gs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    codes = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(k // gs, n, generator=g) * 0.02 + 1e-3
    z = torch.randn(k // gs, n, generator=g) * 0.02
    return x, codes, torch.stack((s, z), dim=-1).bfloat16()


def _dequantized(codes, gs, sz):
    """The weight [N, K] the codes stand for, in float64: (code - 8) * scale + zero."""
    s, z = (sz[..., i].double().T.repeat_interleave(gs, dim=1) for i in (0, 1))
    return (codes.double() - 8) * s + z


# 8 rows: one panel of 8; 33: a panel of 32 and one of 1; 65 and 300: k blocks shared by the panels of a block of
# rows, 300 x 4,864 also in slabs of chunks; N 112 and 80 end in interleaved blocks of 48 and 16 rows (64-row
# layouts), 176 in one of 16 (32-row layouts).
SHAPES = [
    (8, 112, 256, 128),
    (33, 80, 512, 64),
    (65, 176, 896, 32),
    (130, 96, 2560, 256),
    (300, 64, 4864, 128),
]


@pytest.mark.parametrize("layout", int4_gemv.LAYOUTS)
def test_tiles_match_the_reference(tiles, layout):
    if not tiles:
        return
    for m, n, k, gs in SHAPES:
        x, codes, sz = _case(m, n, k, gs, seed=m)
        w = int4_gemv.pack(codes, *layout)
        y = int4_gemv.tile_matmul(x, w, gs, sz, layout)
        # one thread: every group of 32 outputs in turn, one's sums stored while the next one's are formed
        assert torch.equal(int4_gemv.tile_matmul(x, w, gs, sz, layout, threads=1), y)
        deq = _dequantized(codes, gs, sz)
        ref = x.double() @ deq.T
        bound = 1e-6 * (x.double().abs() @ deq.abs().T) + 1e-30  # float32 sums of exact products
        assert ((y.double() - ref).abs() <= bound).all(), (m, n, k, gs, layout)
        y16 = int4_gemv.tile_matmul(x, w, gs, sz, layout, out_dtype=torch.bfloat16)
        assert torch.equal(y16, y.bfloat16()), (m, n, k, gs, layout)  # one rounding of the same sums


@pytest.mark.parametrize("layout", [(64, True), (32, False)])
def test_a_rows_tile_outputs_do_not_depend_on_its_batch(tiles, layout):
    if not tiles:
        return
    x, codes, sz = _case(300, 112, 4864, 128, seed=7)
    w = int4_gemv.pack(codes, *layout)
    y = int4_gemv.tile_matmul(x, w, 128, sz, layout)
    for step in (1, 8, 40, 97):
        parts = [int4_gemv.tile_matmul(x[i : i + step], w, 128, sz, layout) for i in range(0, 300, step)]
        assert torch.equal(torch.cat(parts), y), step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(int4_gemv.tile_matmul(x, w, 128, sz, layout), y)
    finally:
        torch.set_num_threads(threads)


def test_the_layer_takes_tiles_for_bf16_batches_from_tile_min_rows(tiles):
    torch.manual_seed(5)
    lin = nn.Linear(512, 80, bias=True).bfloat16()
    q = quantize_linear(lin, "int4", 64)
    layer = int4_gemv.Layer(q.weight, q.group_size, q.scales_and_zeros)
    layout = int4_gemv.torch_layout()
    for m in (int4_gemv.TILE_MIN_ROWS - 1, int4_gemv.TILE_MIN_ROWS, 40):
        x = torch.randn(m, 512).bfloat16()
        for out in (torch.float32, torch.bfloat16):
            kernel = int4_gemv.int4_matmul(x, q.weight, 64, q.scales_and_zeros, out_dtype=out)
            want = (
                int4_gemv.tile_matmul(x, q.weight, 64, q.scales_and_zeros, layout, out)
                if tiles and m >= int4_gemv.TILE_MIN_ROWS
                else kernel
            )
            assert torch.equal(layer(x, out), want), (m, out)
        xf = x.float()  # float32 activations stay on the int4 kernel
        assert torch.equal(
            layer(xf, torch.float32), int4_gemv.int4_matmul(xf, q.weight, 64, q.scales_and_zeros)
        )
    x = torch.randn(
        int4_gemv.MAX_ROWS + 3, 512
    ).bfloat16()  # past the int4 kernel's rows: the tiles, with AMX
    y = q(x)
    assert (q._cpu_layer is not None) == tiles  # else torch's packed kernel
    if tiles:
        assert torch.equal(
            y, int4_gemv.tile_matmul(x, q.weight, 64, q.scales_and_zeros, layout, torch.bfloat16) + q.bias
        )


def test_non_finite_activations_give_non_finite_rows_alone(tiles):
    if not tiles:
        return
    x, codes, sz = _case(20, 64, 256, 64)
    x[3, 5] = float("nan")
    x[11, 200] = float("inf")
    layout = int4_gemv.torch_layout()
    y = int4_gemv.tile_matmul(x, int4_gemv.pack(codes, *layout), 64, sz, layout)
    assert torch.isnan(y[3]).all() and not torch.isfinite(y[11]).any()
    assert torch.isfinite(y[[i for i in range(20) if i not in (3, 11)]]).all()  # never another row's


def test_what_the_tiles_cannot_take_stays_on_the_int4_kernel(tiles):
    assert not int4_gemv.tiles_take(16, 256) and not int4_gemv.tiles_take(
        48, 96
    )  # groups of whole chunks only
    assert not int4_gemv.tiles_take(128, 256, torch.float32)
    if not tiles:
        return
    x, codes, sz = _case(8, 64, 256, 16)
    layout = int4_gemv.torch_layout()
    with pytest.raises(ValueError, match="refused"):
        int4_gemv.tile_matmul(x, int4_gemv.pack(codes, *layout), 16, sz, layout)
    x, codes, sz = _case(12, 64, 256, 16)  # groups of 16 (the int4 kernel takes them; models use 32-256)
    w = int4_gemv.pack(codes, *layout)
    layer = int4_gemv.Layer(w, 16, sz)
    assert layer.tiles is None
    assert torch.equal(layer(x, torch.float32), int4_gemv.int4_matmul(x, w, 16, sz))


def test_a_failing_self_check_keeps_every_batch_on_the_int4_kernel(tiles, monkeypatch, caplog):
    if not tiles:
        return
    monkeypatch.setattr(int4_gemv, "_tiles", {})
    monkeypatch.setattr(
        int4_gemv, "reference", lambda x, codes, gs, sz: torch.zeros(x.shape[0], codes.shape[0])
    )
    with caplog.at_level("WARNING", logger="sidecar.kernels"):
        assert not int4_gemv.tiles_available()
    assert (
        "off from the float64 product" in int4_gemv._tiles["reason"] and "int4 tile path off" in caplog.text
    )
    assert not int4_gemv.tiles_take(128, 256)
