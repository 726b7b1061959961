"""Our tile-layout bf16 matmul against its float64 reference, its weight layout, and its start-up check.

The layout (pack, unpack, rows) is torch code and is tested on every CPU. The kernel runs where the CPU has AMX BF16
(tile products) or AVX-512 BF16 (dot products over the same layout), and elsewhere must say so (``available()``
False, with a reason). Each kernel test runs twice: the build for this CPU, and one with AMX left out (the AVX-512
BF16 path, as on an AMD Zen 4; on a CPU without AVX-512 BF16 that build must refuse too): the
``tile_build`` fixture of tests/conftest.py."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import amx_gemm


def _case(m, n, k, seed, bias_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return x, w, b


def test_availability_follows_the_cpu(tile_build):
    if not tile_build:
        assert not amx_gemm.available() and amx_gemm.reason()
        with pytest.raises(RuntimeError, match="not available"):
            amx_gemm.AmxLayer(amx_gemm.pack(torch.zeros(32, 32).bfloat16()), 32, None)
        return
    assert amx_gemm.available() and not amx_gemm.reason(), amx_gemm.reason()


@pytest.mark.parametrize("n,k", [(1, 32), (31, 64), (33, 96), (64, 896), (70, 4864), (151, 160)])
def test_layout_round_trips_and_serves_lookups(n, k):
    _, w, _ = _case(1, n, k, seed=n)
    packed = amx_gemm.pack(w)
    assert packed.shape == (-(-n // 32), k // 32, 2, 16, 16, 2)
    assert torch.equal(amx_gemm.unpack(packed, n), w)
    # the tile layout itself: group g, chunk c, half h, pair row r, output j, element e
    g, c, h, r, j, e = (n - 1) // 32, k // 32 - 1, ((n - 1) % 32) // 16, 15, (n - 1) % 16, 1
    assert packed[g, c, h, r, j, e] == w[32 * g + 16 * h + j, 32 * c + 2 * r + e]
    if n % 32:  # the last group's missing rows are zeros
        assert not amx_gemm.unpack(packed, -(-n // 32) * 32)[n:].any()
    ids = torch.tensor([[0, n - 1], [n // 2, 0]])
    assert torch.equal(amx_gemm.rows(packed, ids), w[ids])
    # releasing the source as it is copied gives the same layout
    assert torch.equal(amx_gemm.pack(w.clone(), release_source=True), packed)


def test_pack_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="32-value chunks"):
        amx_gemm.pack(torch.zeros(8, 48).bfloat16())
    with pytest.raises(ValueError, match="32-value chunks"):
        amx_gemm.pack(torch.zeros(8, 64))
    assert not amx_gemm.takes(torch.zeros(8, 48).bfloat16()) and not amx_gemm.takes(torch.zeros(8, 64))


def _runs(build: str) -> bool:
    """Whether the kernel runs in this build. Without AMX or AVX-512 BF16 it must refuse to (Linear keeps oneDNN's
    GEMM or our tiled kernel there); with either it must be on."""
    if not build:
        with pytest.raises(RuntimeError, match="not available"):
            amx_gemm.AmxLayer(amx_gemm.pack(torch.zeros(32, 32).bfloat16()), 32, None)
        return False
    assert amx_gemm.available(), amx_gemm.reason()
    return True


# m: 1 row, partial and whole tiles, two panels, k-blocked batches (> 64 rows) and more than one block of rows
# (300, 100, 4,864), (600, 230, 2,112): rows that go in slabs of chunks, blocks and a partial panel
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 7, 32),
        (1, 4864, 896),
        (3, 50, 96),
        (16, 64, 4864),
        (17, 130, 576),
        (32, 33, 64),
        (45, 96, 1536),
        (65, 40, 288),
        (300, 100, 4864),
        (1100, 70, 96),
        (600, 230, 2112),
    ],
)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_kernel_matches_reference(m, n, k, bias_dtype, tile_build):
    if not _runs(tile_build):
        return
    x, w, b = _case(m, n, k, seed=m * 7 + n, bias_dtype=bias_dtype)
    layer = amx_gemm.AmxLayer(amx_gemm.pack(w), n, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    y32 = layer(x, torch.float32)
    assert y32.dtype == torch.float32 and y32.shape == (m, n)
    # float32 sums of exact products: off by summation order only
    assert (y32.double() - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))
    y16 = layer(x)  # bf16: the float32 result rounded once, to nearest even
    assert torch.equal(y16, y32.bfloat16())
    widened = layer(x, torch.float32, widened=True)  # the bf16 values as float32, in the same pass
    assert widened.dtype == torch.float32 and torch.equal(widened, y16.float())


def test_large_outputs_are_streamed_with_the_same_values(tile_build):
    """Outputs of 8 MiB or more (a model's logits) are written around the caches: the same values as a small batch's
    (a row alone), in every output mode, with a partial last group of columns."""
    if not _runs(tile_build):
        return
    for m, n, out_dtype, widened in (
        (70, 30_000, torch.float32, False),
        (70, 30_016, torch.float32, True),
        (140, 30_016, torch.bfloat16, False),
    ):
        x, w, b = _case(m, n, 64, seed=n, bias_dtype=torch.float32)
        layer = amx_gemm.AmxLayer(amx_gemm.pack(w), n, b)
        y = layer(x, out_dtype, widened=widened)
        assert y.numel() * y.element_size() >= 8 << 20
        ref = x.double() @ w.double().T + b.double()
        bound = (1e-2 if out_dtype is torch.bfloat16 or widened else 1e-5) * float(ref.abs().max())
        assert float((y.double() - ref).abs().max()) <= bound
        for r in (0, 33, m - 1):
            assert torch.equal(layer(x[r : r + 1], out_dtype, widened=widened), y[r : r + 1])


def test_a_row_does_not_depend_on_its_batch_or_the_threads(tile_build):
    if not _runs(tile_build):
        return
    x, w, b = _case(200, 130, 896, seed=3, bias_dtype=torch.float32)
    layer = amx_gemm.AmxLayer(amx_gemm.pack(w), 130, b)
    y = layer(x)
    for rows in (slice(0, 1), slice(37, 38), slice(5, 21), slice(150, 200), slice(0, 64), slice(0, 65)):
        assert torch.equal(layer(x[rows]), y[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), y)
    finally:
        torch.set_num_threads(threads)
    assert layer(x[:0]).shape == (0, 130)
    x, w, b = _case(
        300, 70, 4864, seed=4, bias_dtype=torch.bfloat16
    )  # long rows: the batch goes in slabs of chunks
    layer = amx_gemm.AmxLayer(amx_gemm.pack(w), 70, b)
    y = layer(x)
    for rows in (slice(0, 1), slice(299, 300), slice(0, 64), slice(40, 297)):
        assert torch.equal(layer(x[rows]), y[rows])


def test_layer_checks_its_operands(tile_build):
    if not _runs(tile_build):
        return
    _, w, b = _case(1, 40, 64, seed=1, bias_dtype=torch.float32)
    packed = amx_gemm.pack(w)
    with pytest.raises(ValueError, match="does not hold 73"):
        amx_gemm.AmxLayer(packed, 41 + 32, None)
    with pytest.raises(ValueError, match="bias"):
        amx_gemm.AmxLayer(packed, 40, torch.zeros(39))
    layer = amx_gemm.AmxLayer(packed, 40, b)
    with pytest.raises(ValueError, match="64 bf16 inputs"):
        layer(torch.zeros(2, 32).bfloat16())
    with pytest.raises(ValueError, match="64 bf16 inputs"):
        layer(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="float16 is not what it gives"):
        layer(torch.zeros(2, 64).bfloat16(), torch.float16)
    with pytest.raises(ValueError, match="bfloat16 widened is not what it gives"):
        layer(torch.zeros(2, 64).bfloat16(), torch.bfloat16, widened=True)
    assert layer.matches(packed, b) and not layer.matches(packed.clone(), b)


def test_a_failing_self_check_turns_the_path_off(monkeypatch, caplog, tile_build):
    if not _runs(tile_build):
        return
    monkeypatch.setattr(amx_gemm, "_checked", {})
    monkeypatch.setattr(amx_gemm, "unpack", lambda packed, n: torch.zeros(n, packed.shape[1] * 32).bfloat16())
    with caplog.at_level("WARNING", logger="sidecar.kernels"):
        assert not amx_gemm.available()
    assert "does not give the weight back" in amx_gemm.reason()
    assert "oneDNN" in caplog.text and not amx_gemm.takes(torch.zeros(8, 64).bfloat16())


def test_gate_up_pairs_layout():
    _, w, _ = _case(1, 64, 96, seed=5)
    assert amx_gemm.pairs_of(w, 32) == 32 and amx_gemm.pairs_of(w, 16) == 0 and amx_gemm.pairs_of(w, 0) == 0
    assert amx_gemm.pairs_of(torch.zeros(40, 32).bfloat16(), 20) == 0  # 20 is not a multiple of 16
    packed = amx_gemm.pack(w, pairs=32)
    # group 1's first half: gate rows 16..31; its second half: up rows 48..63
    assert torch.equal(packed[1, :, 0], amx_gemm.pack(w[16:32].repeat(2, 1))[0, :, 0])
    assert torch.equal(packed[1, :, 1], amx_gemm.pack(w[48:64].repeat(2, 1))[0, :, 0])
    assert torch.equal(amx_gemm.unpack(packed, 64, 32), w)
    assert torch.equal(amx_gemm.pack(w.clone(), release_source=True, pairs=32), packed)
    with pytest.raises(ValueError, match="gate/up pairs"):
        amx_gemm.pack(w, pairs=16)


@pytest.mark.parametrize("m,k", [(1, 160), (5, 160), (32, 160), (70, 160), (300, 160), (300, 2112)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_gate_up_pairs_give_the_projection_and_its_activation(m, k, bias_dtype, tile_build):
    """Held in pairs, a gate/up projection gives its own outputs (the same bits as the plain layout) or, in one pass,
    silu(gate) * up -- the bits norm_act.silu_mul gives from those outputs. (300, 2112): rows long enough to go in
    slabs of chunks."""
    if not _runs(tile_build):
        return
    from sidecar.model.kernels.cpu import norm_act

    x, w, b = _case(m, 2 * 48, k, seed=m, bias_dtype=bias_dtype)
    plain = amx_gemm.AmxLayer(amx_gemm.pack(w), 96, b)(x)
    paired = amx_gemm.AmxLayer(amx_gemm.pack(w, pairs=48), 96, b, pairs=48)
    assert torch.equal(paired(x), plain)
    assert torch.equal(paired(x, torch.float32), amx_gemm.AmxLayer(amx_gemm.pack(w), 96, b)(x, torch.float32))
    act = paired(x, silu=True)
    assert act.shape == (m, 48) and torch.equal(act, norm_act.silu_mul(plain))
    with pytest.raises(ValueError, match="is not what it gives"):
        amx_gemm.AmxLayer(amx_gemm.pack(w), 96, b)(x, silu=True)
    with pytest.raises(ValueError, match="is not what it gives"):
        paired(x, torch.float32, silu=True)
    with pytest.raises(ValueError, match="not gate/up pairs"):
        amx_gemm.AmxLayer(amx_gemm.pack(w), 96, b, pairs=40)
