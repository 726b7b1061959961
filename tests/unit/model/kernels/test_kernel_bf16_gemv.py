"""Our CPU bf16 decode kernel against its float64 reference, and the models' Linear that uses it."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import bf16_gemv, cpu_build
from sidecar.model.linear import Linear


def _refused_without_bf16(*args) -> bool:
    """On a CPU with neither AVX-512 BF16 nor AVX2 + FMA the kernel refuses to run (Linear then uses F.linear)."""
    if bf16_gemv.available():
        return False
    with pytest.raises((RuntimeError, AssertionError)):
        bf16_gemv.bf16_matmul(*args)
    return True


def _case(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def test_availability_follows_the_cpu():
    flags = open("/proc/cpuinfo").read().split()
    expected = (
        "avx512_bf16" if "avx512_bf16" in flags else "avx2" if "avx2" in flags and "fma" in flags else ""
    )
    assert bf16_gemv.isa() == expected, cpu_build.reason("bf16_gemv")
    assert bf16_gemv.available() == bool(expected)


@pytest.mark.parametrize(
    "m,n,k,bias",
    [
        (1, 7, 32, True),
        (1, 4864, 896, False),
        (2, 50, 96, True),
        (3, 130, 576, False),
        (4, 33, 64, True),
        (5, 41, 896, True),
        (9, 17, 1536, False),
        (16, 64, 4864, True),
    ],
)
def test_kernel_matches_reference(m, n, k, bias):
    x, w, b = _case(m, n, k, bias, seed=m * 7 + n)
    if _refused_without_bf16(x, w, b):
        return
    y = bf16_gemv.bf16_matmul(x, w, b)
    ref = bf16_gemv.reference(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # bf16 inputs are exact in float32; only the float32 accumulation order differs from float64.
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    # bf16 out: the same sums rounded once to nearest even, as torch rounds float32 to bf16; a bf16
    # bias and its float32 copy give the same bits.
    y16 = bf16_gemv.bf16_matmul(x, w, b, torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.to(torch.bfloat16))
    if b is not None:
        assert torch.equal(bf16_gemv.bf16_matmul(x, w, b.float(), torch.bfloat16), y16)


@pytest.mark.parametrize(
    "m,n,k,bias",
    [
        (1, 7, 32, True),
        (1, 4864, 896, False),
        (3, 130, 576, True),
        (4, 33, 64, False),
        (5, 41, 896, True),
        (16, 66, 4864, True),
    ],
)
def test_the_tiled_layout_gives_the_plain_layouts_bits(m, n, k, bias):
    """Same sums in the same order from either layout; row counts that leave a padded last tile included."""
    x, w, b = _case(m, n, k, bias, seed=m * 11 + n)
    tiled = bf16_gemv.tile_weight(w)
    assert tiled.shape == (-(-n // 4), k // 32, 4, 32)
    assert torch.equal(tiled.transpose(1, 2).reshape(-1, k)[:n], w)  # four rows a tile, in order
    assert not tiled.transpose(1, 2).reshape(-1, k)[n:].any()  # padding rows are zero
    if not bf16_gemv.available():
        with pytest.raises((RuntimeError, AssertionError)):
            bf16_gemv.bf16_matmul_tiled(x, tiled, n, b)
        return
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(
            bf16_gemv.bf16_matmul_tiled(x, tiled, n, b, out), bf16_gemv.bf16_matmul(x, w, b, out)
        )


@pytest.mark.parametrize("n,k", [(8, 32), (13, 96), (4097, 256)])
def test_tiling_that_releases_its_source_gives_the_same_layout_and_frees_the_plain_pages(n, k):
    """tile_weight(w, release_source=True) (the loader's: a plain weight read for the last time) lays the rows out
    as the copying tile_weight does, and gives the whole pages of the plain weight back as it goes (anonymous
    memory reads as zeros after); a view of a larger tensor is left as it is."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    src = w.clone()
    assert torch.equal(bf16_gemv.tile_weight(src, release_source=True), bf16_gemv.tile_weight(w))
    if src.numel() * 2 >= 4 * 4096:  # whole pages inside it: released (randn gives no exact zero)
        assert int((src == 0).sum()) * 2 >= src.numel() * 2 - 2 * 4096
    big = torch.cat([w, w])
    view = big[n:]
    assert torch.equal(bf16_gemv.tile_weight(view, release_source=True), bf16_gemv.tile_weight(w))
    assert torch.equal(big[n:], w) and torch.equal(big[:n], w)


def test_tiling_a_weight_read_from_a_checkpoint_leaves_the_file_as_it_was(tmp_path):
    """The loader's weights may be pages of a private mapping of the checkpoint (safetensors): releasing them
    drops them from this process, the file keeps its bytes (a second load reads the same weight)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(2048, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt", device="cpu") as h:
        first = h.get_tensor("w")
    assert torch.equal(bf16_gemv.tile_weight(first, release_source=True), bf16_gemv.tile_weight(w))
    del first
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt", device="cpu") as h:
        assert torch.equal(h.get_tensor("w"), w)


def test_bad_tiled_shapes_are_refused():
    x, w, b = _case(2, 10, 64, True, 0)
    tiled = bf16_gemv.tile_weight(w)
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.tile_weight(w[:, :48])
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_matmul_tiled(x, tiled, 13, None)  # 13 rows need 4 tiles, not 3
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_matmul_tiled(x[:, :32], tiled, 10, b)
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_matmul_tiled(x, tiled, 10, b[:9])


def test_the_row_limit_is_where_the_kernel_stops_keeping_up():
    def ms(table):
        return lambda m: table[m] / 1e3

    ones = {m: 1.0 for m in bf16_gemv.CALIBRATION_ROWS}
    # oneDNN overtakes at 8 rows (Zen 4's shape): the kernel keeps 4 (a tie within the margin stays ours)
    assert (
        bf16_gemv.rows_limit(
            ms({2: 0.3, 4: 0.53, 8: 1.05, 16: 1.73}), ms({2: 0.4, 4: 0.51, 8: 0.66, 16: 1.33})
        )
        == 4
    )
    assert bf16_gemv.rows_limit(ms(ones), ms(ones)) == bf16_gemv.MAX_ROWS == bf16_gemv.CALIBRATION_ROWS[-1]
    assert bf16_gemv.rows_limit(ms({m: 2.0 for m in ones}), ms(ones)) == 1
    # the first count it loses at ends the range, even if it would win again above
    assert bf16_gemv.rows_limit(ms({2: 1.0, 4: 2.0, 8: 1.0, 16: 1.0}), ms(ones)) == 2


def test_the_measured_limit_and_its_override(monkeypatch):
    x, w, _ = _case(1, 64, 128, False, 0)
    tiled = bf16_gemv.tile_weight(w)
    monkeypatch.setenv(bf16_gemv.ROWS_ENV, "6")
    assert bf16_gemv.measure_rows_limit([(tiled, 64, None)]) == 6  # nothing measured
    for bad in ("0", "17", "x"):
        monkeypatch.setenv(bf16_gemv.ROWS_ENV, bad)
        with pytest.raises(ValueError, match=bf16_gemv.ROWS_ENV):
            bf16_gemv.measure_rows_limit([(tiled, 64, None)])
    monkeypatch.delenv(bf16_gemv.ROWS_ENV)
    if not bf16_gemv.available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    monkeypatch.setattr(bf16_gemv, "CALIBRATION_BYTES", 1 << 20)
    assert bf16_gemv.measure_rows_limit([(tiled, 64, packed)], reps=2) in (1, *bf16_gemv.CALIBRATION_ROWS)


def test_bad_shapes_are_refused():
    x, w, b = _case(1, 4, 64, True, 0)
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_matmul(x[:, :48], w[:, :48], b)  # K not a multiple of 32
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.bf16_matmul(x.float(), w, b)


@pytest.mark.parametrize("rows", [1, 3, bf16_gemv.MAX_ROWS, bf16_gemv.MAX_ROWS + 1])
@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("tiled", [False, True])
def test_linear_uses_the_kernel_for_small_bf16_batches_only(rows, kernels, tiled, monkeypatch):
    calls = []
    if tiled:  # a tiled copy is read through its checked layer
        real_call = bf16_gemv.TiledLayer.__call__
        monkeypatch.setattr(bf16_gemv.TiledLayer, "__call__", lambda *a: calls.append(1) or real_call(*a))
    else:
        real = bf16_gemv.bf16_matmul
        monkeypatch.setattr(bf16_gemv, "bf16_matmul", lambda *a: calls.append(1) or real(*a))
    if not kernels:
        monkeypatch.setattr(bf16_gemv, "available", lambda: False)
    torch.manual_seed(rows)
    lin = Linear(96, 70, bias=True).bfloat16()
    if (
        tiled
    ):  # what pack_weights gives a bf16 layer where the kernel runs (the plain weight kept here for ref)
        lin.tiled = bf16_gemv.tile_weight(lin.weight.detach())
    x = torch.randn(2, rows, 96).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 70)
    assert bool(calls) == (kernels and bf16_gemv.available() and 2 * rows <= bf16_gemv.MAX_ROWS)
    ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()  # one bf16 rounding of the output
    assert lin.float()(x.float()).dtype == torch.float32  # float32 layers are F.linear's


# 1-3 rows: dot_tile; from 4: outer products over groups of 16 weight rows (panels of 4-6 rows; 7: 4 + 3; a padded
# last group: 9, 41, 66, 70, 130, 1,030 rows), several passes over K (4,864; 2,080 ends in one of 32), three row
# chunks (220); a thread reads its next pass or block ahead (many blocks: 1,030 rows)
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 4864, 896),
        (2, 130, 576),
        (3, 33, 64),
        (4, 41, 896),
        (7, 66, 1536),
        (8, 70, 896),
        (15, 40, 1056),
        (16, 64, 4864),
        (17, 130, 2080),
        (33, 1030, 2080),
        (40, 9, 96),
        (64, 1024, 896),
        (220, 9, 4864),
    ],
)
def test_the_avx2_path_on_any_avx2_cpu(m, n, k, monkeypatch):
    """The path an AVX2-only CPU (Zen 2/3) runs, built with -mavx2 -mfma wherever the CPU has them (an AVX-512
    machine too): float32 sums of exact products, tiled = plain bits, and a row's result whatever its batch."""
    flags = open("/proc/cpuinfo").read().split()
    if "avx2" not in flags or "fma" not in flags:  # a pre-x86-64-v3 CPU: no path, Linear keeps F.linear
        assert not bf16_gemv.available() or bf16_gemv.isa() == "avx512_bf16"
        return
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mavx2 -mfma")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert bf16_gemv.isa() == "avx2", cpu_build.reason("bf16_gemv")
    x, w, b = _case(m, n, k, True, seed=m * 13 + n)
    y = bf16_gemv.bf16_matmul(x, w, b)
    ref = bf16_gemv.reference(x, w, b)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    tiled = bf16_gemv.tile_weight(w)
    for out in (torch.float32, torch.bfloat16):
        plain = bf16_gemv.bf16_matmul(x, w, b, out)
        assert torch.equal(bf16_gemv.bf16_matmul_tiled(x, tiled, n, b, out), plain)
        # each row alone gives the bits it got in the batch (one order of sums, whatever the register tile)
        for i in (0, m - 1):
            assert torch.equal(bf16_gemv.bf16_matmul_tiled(x[i : i + 1], tiled, n, b, out), plain[i : i + 1])
    assert torch.equal(bf16_gemv.untile_weight(tiled, n), w)
    nan = x.clone()
    nan[0, 5] = float("nan")
    for out in (torch.float32, torch.bfloat16):  # a NaN input poisons its row only, a NaN in bf16 too
        y = bf16_gemv.bf16_matmul_tiled(nan, tiled, n, b, out)
        assert y[0].isnan().all() and torch.equal(y[1:], bf16_gemv.bf16_matmul(x, w, b, out)[1:])


def test_a_checked_tiled_layer_gives_the_calls_bits_and_follows_its_buffers():
    """bf16_gemv.TiledLayer (what Linear holds for its tiled copy) computes what bf16_matmul_tiled computes; a
    Linear whose tiled buffer or bias is replaced builds a new one."""
    if not bf16_gemv.available():
        with pytest.raises(RuntimeError, match="not available"):
            bf16_gemv.TiledLayer(bf16_gemv.tile_weight(torch.zeros(4, 32).bfloat16()), 4, None)
        return
    x, w, b = _case(5, 70, 96, True, seed=2)
    tiled = bf16_gemv.tile_weight(w)
    layer = bf16_gemv.TiledLayer(tiled, 70, b)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(layer(x, out), bf16_gemv.bf16_matmul_tiled(x, tiled, 70, b, out))
    with pytest.raises(ValueError, match="96 bf16 inputs"):
        layer(x.float(), torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        bf16_gemv.TiledLayer(tiled, 75, b)
    lin = Linear(96, 70, bias=True).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    lin.tiled = tiled
    y = lin(x)
    first = lin._tiled_layer
    assert first is not None and torch.equal(y, bf16_gemv.bf16_matmul_tiled(x, tiled, 70, b, torch.bfloat16))
    lin.bias = torch.nn.Parameter(b + 1)
    y2 = lin(x)
    assert lin._tiled_layer is not first and torch.equal(
        y2, bf16_gemv.bf16_matmul_tiled(x, tiled, 70, b + 1, torch.bfloat16)
    )
