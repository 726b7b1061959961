"""The Triton elementwise kernels (rope + KV write, residual add + RMSNorm, silu * up) against the torch
references they replace."""

import pytest
import torch

from sidecar.model.attention import write_kv
from sidecar.model.kernels.cpu import norm_act
from sidecar.model.kernels.triton import ops as triton_ops

# Torch rounds after every op in the model dtype; the kernels do too, so only the order of the norm's
# float32 sum and exp / rsqrt may differ: a few float32 ulps, or one bf16 rounding step.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def _rope_torch(qkv, cos, sin, slots, kc, vc, nh, nkv, hd):
    t = qkv.shape[0]
    nqk = (nh + nkv) * hd
    qk = qkv[:, :nqk].view(t, nh + nkv, hd)
    qk = qk * cos + torch.roll(qk, hd // 2, dims=-1) * sin
    q, k = qk[:, :nh], qk[:, nh:]
    v = qkv[:, nqk:].view(t, nkv, hd)
    write_kv(kc, vc, k, v, slots)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,nh,nkv,hd,want_k", [(1, 4, 2, 16, False), (5, 4, 4, 24, True), (3, 8, 2, 32, True)]
)
def test_rope_store_kv_matches_torch(t, nh, nkv, hd, want_k, dtype, device):
    g = torch.Generator().manual_seed(t * hd)
    to = dict(dtype=dtype, device=device)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g).to(**to)
    ang = torch.randn(t, 1, hd, generator=g)
    sign = torch.cat((-torch.ones(hd // 2), torch.ones(hd // 2)))
    cos, sin = ang.cos().to(**to), (ang.sin() * sign).to(**to)
    bs, blocks = 4, 6
    slots = torch.randperm(bs * blocks, generator=g)[:t].to(device)
    kc = torch.randn(blocks, bs, nkv, hd, generator=g).to(**to)
    vc = torch.randn(blocks, bs, nkv, hd, generator=g).to(**to)
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = triton_ops.rope_store_kv(qkv, cos, sin, slots.int(), kc, vc, nh, nkv, hd, want_k)
    rq, rk, rv = _rope_torch(qkv, cos, sin, slots, kc2, vc2, nh, nkv, hd)
    # Products and the sum round as torch's do, and the interpreter contracts nothing: same bits here.
    exact = dict(atol=0, rtol=0) if not torch.cuda.is_available() else TOL[dtype]
    torch.testing.assert_close(q, rq, **exact)
    torch.testing.assert_close(kc, kc2, **exact)  # rope(k) written at its slot, other slots untouched
    assert torch.equal(vc, vc2)
    assert (k is None) != want_k and (k is None or torch.equal(k, rk))
    assert torch.equal(v, rv) and v.data_ptr() == qkv[:, (nh + nkv) * hd :].data_ptr()


def test_rope_store_kv_skips_negative_slots_and_refuses_what_it_cannot_take(device):
    nh, nkv, hd = 2, 1, 16
    qkv = torch.randn(2, (nh + 2 * nkv) * hd, device=device)
    cos, sin = torch.ones(2, 1, hd, device=device), torch.zeros(2, 1, hd, device=device)
    kc, vc = torch.zeros(2, 4, nkv, hd, device=device), torch.zeros(2, 4, nkv, hd, device=device)
    triton_ops.rope_store_kv(qkv, cos, sin, torch.tensor([5, -1], device=device), kc, vc, nh, nkv, hd, False)
    assert torch.equal(kc.view(-1, hd)[5], qkv[0, nh * hd : (nh + 1) * hd])
    assert (
        torch.count_nonzero(kc.view(-1, hd).abs().sum(1)) == 1
        and torch.count_nonzero(vc.view(-1, hd).sum(1)) == 1
    )
    assert (
        triton_ops.rope_store_kv(
            qkv, cos.double(), sin, torch.tensor([0, 1], device=device), kc, vc, nh, nkv, hd, False
        )
        is None
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim,with_delta", [(1, 64, True), (3, 100, True), (2, 48, False)])
def test_add_rms_norm_matches_reference(rows, dim, with_delta, dtype, device):
    g = torch.Generator().manual_seed(rows + dim)
    to = dict(dtype=dtype, device=device)
    h = (torch.randn(rows, dim, generator=g) * 3).to(**to)
    delta = torch.randn(rows, dim, generator=g).to(**to) if with_delta else None
    w = torch.randn(dim, generator=g).to(**to)
    out, s = triton_ops.add_rms_norm(h, delta, w, 1e-6)
    ref_out, ref_s = norm_act.add_rms_norm_reference(h, delta, w, 1e-6)
    assert torch.equal(s, ref_s) and (with_delta or s is h)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,inter", [(1, 16), (4, 1500)]
)  # 1500: two programs per row, the last one partial
def test_silu_mul_matches_reference(rows, inter, dtype, device):
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype=dtype, device=device)
    out = triton_ops.silu_mul(gu)
    assert out.shape == (rows, inter)
    torch.testing.assert_close(out, norm_act.silu_mul_reference(gu), **TOL[dtype])


def test_ops_refuse_inputs_they_do_not_take(device):
    assert triton_ops.silu_mul(torch.randn(2, 7, device=device)) is None  # odd width: no gate/up halves
    assert triton_ops.silu_mul(torch.randn(4, 8, device=device).t()) is None
    h = torch.randn(2, 8, device=device)
    assert triton_ops.add_rms_norm(h, None, torch.ones(9, device=device), 1e-6) is None


_Q = (4, 2, 16, 4, 5)  # the quantized-cache cases: q heads, KV heads, head dim, block size, blocks


def _quant_case(seed: int, t: int, v_rows: dict, to: dict):
    """(qkv [t, ...], cos, sin, slots) of random tokens, the first V head of each token in ``v_rows`` set."""
    nh, nkv, hd, bs, blocks = _Q
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 4).to(**to)
    vo = (nh + nkv) * hd
    for row, values in v_rows.items():
        qkv[row, vo : vo + hd] = torch.tensor(values)
    ang = torch.randn(t, 1, hd, generator=g)
    sign = torch.cat((-torch.ones(hd // 2), torch.ones(hd // 2)))
    slots = torch.randperm(bs * blocks, generator=g)[:t].to(to["device"])
    return qkv, ang.cos().to(**to), (ang.sin() * sign).to(**to), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_quantizes_on_write_as_kv_quant(dtype, device):
    """With an int8 cache the kernel stores kv_quant.write's codes and scales for rope(k) and v: an all-zero
    row (scale 1) and exact halves (round half to even) included."""
    from sidecar.model import kv_quant

    nh, nkv, hd, bs, blocks = _Q
    to = dict(dtype=dtype, device=device)
    halves = [254.0] + [float(2 * i + 1) for i in range(hd - 1)]  # scale 2: exact halves
    qkv, cos, sin, slots = _quant_case(3, 6, {1: [0.0] * hd, 2: halves}, to)  # a zero V row: scale 1
    cache = kv_quant.allocate(blocks, bs, nkv, hd, torch.int8, torch.device(device))
    for x in cache:
        x.zero_()
    ref = tuple(x.clone() for x in cache)
    q, k, v = triton_ops.rope_store_kv(
        qkv, cos, sin, slots.int(), cache[0], cache[1], nh, nkv, hd, True, kv_scales=cache[2:]
    )
    rq, rk, rv = _rope_torch(
        qkv,
        cos,
        sin,
        slots,
        torch.empty_like(qkv[:1]).new_zeros(blocks, bs, nkv, hd),
        torch.zeros(blocks, bs, nkv, hd, **to),
        nh,
        nkv,
        hd,
    )
    kv_quant.write(ref, rk, rv, slots)
    if torch.cuda.is_available():  # rope may round differently: codes within one step
        assert (cache[0].int() - ref[0].int()).abs().max() <= 1
        assert torch.equal(cache[1], ref[1]) and torch.equal(cache[3], ref[3])
    else:
        for got, want in zip(cache, ref):
            assert torch.equal(got, want)
    assert torch.equal(
        cache[1].view(-1, nkv, hd)[slots[2], 0, :4].cpu(), torch.tensor([127, 0, 2, 2], dtype=torch.int8)
    )


# e4m3 rounding cases at scale 1 (the row's largest value is 448): halfway between normals (to the even
# mantissa), subnormals (multiples of 2^-9) and their halves, the largest subnormal rounding up into the smallest
# normal, a carry into the exponent, negative zero and the sign.
_E4M3_ROW = [
    448.0,
    1.0625,
    1.1875,
    -1.1875,
    2.0**-10,
    3 * 2.0**-10,
    2.0**-6 - 2.0**-10,
    2.0**-6,
    -5 * 2.0**-10,
    15.5,
    31.0,
    0.0,
    -0.0,
    232.0,
    1.0 + 2.0**-4 + 2.0**-20,
    -448.0,
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_writes_fp8_as_kv_quant(dtype, device):
    """With an fp8 e4m3 cache the kernel stores kv_quant.write's bytes and scales for rope(k) and v."""
    from sidecar.model import kv_quant

    nh, nkv, hd, bs, blocks = _Q
    to = dict(dtype=dtype, device=device)
    rows = {1: [0.0] * hd}  # a zero V row: scale 1
    if dtype == torch.float32:  # the rounding cases need float32 inputs to reach the kernel as they are
        rows[3] = _E4M3_ROW
    qkv, cos, sin, slots = _quant_case(4, 5, rows, to)
    cache = kv_quant.allocate(blocks, bs, nkv, hd, torch.float8_e4m3fn, torch.device(device))
    for x in cache:
        x.view(torch.uint8).zero_() if x.dtype == torch.float8_e4m3fn else x.zero_()
    ref = tuple(x.clone() for x in cache)
    assert (
        triton_ops.rope_store_kv(
            qkv, cos, sin, slots.int(), cache[0], cache[1], nh, nkv, hd, True, kv_scales=cache[2:]
        )
        is not None
    )
    _, rk, rv = _rope_torch(
        qkv,
        cos,
        sin,
        slots,
        torch.zeros(blocks, bs, nkv, hd, **to),
        torch.zeros(blocks, bs, nkv, hd, **to),
        nh,
        nkv,
        hd,
    )
    kv_quant.write(ref, rk, rv, slots)
    bits = lambda x: x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x  # noqa: E731
    assert torch.equal(bits(cache[1]), bits(ref[1])) and torch.equal(cache[3], ref[3])  # V: no rope, exact
    if torch.cuda.is_available():  # rope may round differently: K codes within one step
        assert (bits(cache[0]).int() - bits(ref[0]).int()).abs().max() <= 1
    else:
        assert torch.equal(bits(cache[0]), bits(ref[0])) and torch.equal(cache[2], ref[2])
    if dtype == torch.float32:
        row = bits(cache[1]).view(-1, nkv, hd)[slots[3], 0].cpu()
        assert torch.equal(row, torch.tensor(_E4M3_ROW).to(torch.float8_e4m3fn).view(torch.uint8))
