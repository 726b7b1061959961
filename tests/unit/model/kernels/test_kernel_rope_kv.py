"""Our CPU rotary-embedding + KV-cache-write kernel against the model's torch path, bit for bit."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.attention import write_kv
from sidecar.model.kernels.cpu import cpu_build, rope_kv


def _case(t, nh, nkv, hd, dtype, seed=0):
    num_slots = 2 * t + 7
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 4).to(dtype)
    ang = torch.randn(t, hd // 2, generator=g).repeat(1, 2) * 50  # as init_rope builds them: halves repeat
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cos, sin = ang.cos().to(dtype), (ang.sin() * sign).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:t]
    caches = [torch.randn(num_slots, nkv, hd, generator=g).to(dtype) for _ in range(2)]
    return qkv, cos, sin, slots, caches


def _torch_path(qkv, cos, sin, slots, k_cache, v_cache, nh, nkv, hd):
    """What layers.Attention does without the kernel."""
    t, nqk = qkv.shape[0], (nh + nkv) * hd
    qk = qkv[:, :nqk].view(t, nh + nkv, hd)
    qk = qk * cos[:, None, :] + torch.roll(qk, hd // 2, dims=-1) * sin[:, None, :]
    q, k = qk[:, :nh], qk[:, nh:]
    v = qkv[:, nqk:].view(t, nkv, hd)
    write_kv(k_cache, v_cache, k, v, slots)
    return q, k, v


def test_kernel_builds_on_this_machine():
    assert rope_kv.available(), cpu_build.reason("rope_kv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,nh,nkv,hd", [(1, 14, 2, 64), (37, 9, 3, 64), (5, 4, 4, 6), (300, 8, 2, 128), (3, 2, 1, 40)]
)
@pytest.mark.parametrize("want_k", [True, False])
def test_same_bits_as_the_torch_path(t, nh, nkv, hd, dtype, want_k):
    qkv, cos, sin, slots, (kc, vc) = _case(t, nh, nkv, hd, dtype, seed=t + hd)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, k, v = rope_kv.rope_store_kv(qkv, cos, sin, slots, kc, vc, nh, nkv, hd, want_k)
    q_ref, k_ref, v_ref = _torch_path(qkv, cos, sin, slots, kc_ref, vc_ref, nh, nkv, hd)
    assert torch.equal(q, q_ref) and torch.equal(v, v_ref)
    assert torch.equal(k, k_ref) if want_k else k is None
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # other slots untouched, new ones written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,nh,nkv,hd,rot", [(1, 8, 2, 256, 64), (3, 4, 2, 16, 4), (40, 6, 3, 64, 12)])
def test_partial_rotary_rotates_the_first_channels_as_the_torch_path(t, nh, nkv, hd, rot, dtype):
    # Qwen3.5's attention rotates a quarter of each head; the channels past the tables pass through
    from sidecar.model.layers import rotate

    qkv, _, _, slots, (kc, vc) = _case(t, nh, nkv, hd, dtype, seed=rot)
    _, cos, sin, _, _ = _case(t, 1, 1, rot, dtype, seed=rot + 1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, k, v = rope_kv.rope_store_kv(qkv, cos, sin, slots, kc, vc, nh, nkv, hd, True)
    nqk = (nh + nkv) * hd
    qk = rotate(qkv[:, :nqk].view(t, nh + nkv, hd), cos[:, None], sin[:, None])
    write_kv(kc_ref, vc_ref, qk[:, nh:], qkv[:, nqk:].view(t, nkv, hd), slots)
    assert torch.equal(q, qk[:, :nh]) and torch.equal(k, qk[:, nh:])
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert not torch.equal(q[..., :rot], qkv[:, : nh * hd].view(t, nh, hd)[..., :rot])  # rotated, not copied
    odd = (cos[:, :-1].contiguous(), sin[:, :-1].contiguous())  # an odd table width: refused
    assert rope_kv.rope_store_kv(qkv, *odd, slots, kc, vc, nh, nkv, hd, True) is None


def test_inputs_it_does_not_take_return_none():
    qkv, cos, sin, slots, (kc, vc) = _case(4, 4, 2, 64, torch.float32)
    args = (slots, kc, vc, 4, 2, 64, True)
    assert (
        rope_kv.rope_store_kv(qkv.half(), cos.half(), sin.half(), *args) is None
    )  # a dtype it does not take
    assert rope_kv.rope_store_kv(qkv, cos.bfloat16(), sin, *args) is None  # mixed dtypes
    assert rope_kv.rope_store_kv(qkv[:, :-64], cos, sin, *args) is None  # not a qkv row of these heads
    wide = torch.randn(4, qkv.shape[1] * 2)[:, ::2]
    assert rope_kv.rope_store_kv(wide, cos, sin, *args) is None  # not contiguous
    assert rope_kv.rope_store_kv(qkv, cos, sin, slots.int(), kc, vc, 4, 2, 64, True) is None


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets_give_the_same_bits(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert rope_kv.available(), cpu_build.reason("rope_kv")
    for dtype in (torch.float32, torch.bfloat16):
        for nh, nkv, hd in ((14, 2, 64), (4, 4, 6)):
            qkv, cos, sin, slots, (kc, vc) = _case(9, nh, nkv, hd, dtype, seed=hd)
            kc_ref, vc_ref = kc.clone(), vc.clone()
            q, k, _ = rope_kv.rope_store_kv(qkv, cos, sin, slots, kc, vc, nh, nkv, hd, True)
            q_ref, k_ref, _ = _torch_path(qkv, cos, sin, slots, kc_ref, vc_ref, nh, nkv, hd)
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(kc, kc_ref)
