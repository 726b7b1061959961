"""The models' Linear with weights packed for oneDNN, against F.linear on the plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sidecar.config import EngineConfig
from sidecar.model import linear as linear_mod
from sidecar.model import linear_layout
from sidecar.model.kernels.cpu import amx_gemm, bf16_gemv, f32_gemv
from sidecar.model.linear import Linear, can_pack
from sidecar.model.linear_layout import TiledEmbedding, pack_weights
from sidecar.model.llama import LlamaForCausalLM, ModelArgs

BF16_PACKS = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
# An AVX2-only CPU (Zen 2/3): no oneDNN bf16, and our kernel's AVX2 path holds bf16 layers in its tiled layout alone
TILE_ONLY = not BF16_PACKS and bf16_gemv.available()
# A CPU with AMX: bf16 layers in its tile layout alone, our AMX kernel at every batch size
AMX = amx_gemm.available()


def _layer(n, k, dtype, bias, seed=0):
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias).to(dtype)
    return lin, lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_computes_what_f_linear_computes(dtype, rows, bias):
    lin, w, b = _layer(200, 96, dtype, bias, seed=rows)
    if (
        dtype == torch.bfloat16 and TILE_ONLY
    ):  # no oneDNN bf16: the tiled layout alone, our kernel at every size
        assert lin.pack() and not lin.pack()
        assert lin.weight is None and lin.packed is None and torch.equal(lin.dense_weight(), w)
        x = torch.randn(rows, 96).bfloat16()
        y = lin(x)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert y.dtype == torch.bfloat16 and (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert torch.equal(y, bf16_gemv.bf16_matmul_tiled(x, lin.tiled, 200, b, torch.bfloat16))
        x3 = torch.randn(2, rows, 192).bfloat16()[..., ::2]
        assert torch.allclose(
            lin(x3).double(),
            F.linear(x3.double(), w.double(), None if b is None else b.double()),
            rtol=0,
            atol=2e-2 * float(ref.abs().max()),
        )
        return
    if dtype == torch.bfloat16 and AMX:
        assert lin.pack() and not lin.pack()
        assert (
            lin.weight is None
            and lin.packed is None
            and lin.tiled is None
            and torch.equal(lin.dense_weight(), w)
        )
        x = torch.randn(rows, 96).bfloat16()
        y = lin(x)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert y.dtype == torch.bfloat16 and (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert torch.equal(y, amx_gemm.AmxLayer(lin.amx, 200, b)(x))
        assert torch.equal(lin(x[-1:]), y[-1:])  # a row's result does not depend on its batch
        x3 = torch.randn(2, rows, 192).bfloat16()[..., ::2]
        assert torch.allclose(
            lin(x3).double(),
            F.linear(x3.double(), w.double(), None if b is None else b.double()),
            rtol=0,
            atol=2e-2 * float(ref.abs().max()),
        )
        return
    if (
        dtype == torch.bfloat16 and not BF16_PACKS
    ):  # neither oneDNN bf16 nor our kernel: the weight stays plain
        assert not lin.pack() and lin.packed is None and torch.equal(lin.weight, w)
        x = torch.randn(rows, 96).bfloat16()
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert (lin(x).double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        return
    assert lin.pack()
    assert lin.weight is None and lin.packed is not None  # the plain copy is gone
    assert torch.equal(lin.dense_weight(), w)
    x = torch.randn(rows, 96).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, 200)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    if dtype == torch.float32:
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    else:
        # Float32 accumulation, one rounding to bf16 -- and the same bits as torch's bf16 GEMM.
        assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        if rows > 1:
            assert torch.equal(y, F.linear(x, w, b))
    # Leading dimensions and non-contiguous inputs, as the models pass them.
    x3 = torch.randn(2, rows, 192).to(dtype)[..., ::2]
    assert torch.allclose(
        lin(x3).double(),
        F.linear(x3.double(), w.double(), None if b is None else b.double()),
        rtol=0,
        atol=2e-2 * float(ref.abs().max()),
    )


def test_empty_batch_and_packing_once():
    lin, w, b = _layer(40, 64, torch.float32, True)
    assert lin.pack()
    assert lin(torch.empty(0, 64)).shape == (0, 40)
    assert not lin.pack()  # packed once


def test_what_is_not_packed(monkeypatch):
    assert not can_pack(None)
    assert (
        not can_pack(torch.randn(4, 4, dtype=torch.float16)) or torch.ops.mkldnn._is_mkldnn_fp16_supported()
    )
    assert not can_pack(torch.randn(4))
    assert can_pack(torch.randn(4, 4)) == torch.backends.mkldnn.is_available()
    if not BF16_PACKS:
        assert not can_pack(torch.randn(4, 4).bfloat16())
    monkeypatch.setenv("SIDECAR_CPU_KERNELS", "0")  # the reference path: plain weights, F.linear
    assert not can_pack(torch.randn(4, 4))
    lin, w, _ = _layer(8, 32, torch.float32, False)
    assert not lin.pack() and lin.weight is not None and lin.packed is None


def _tiny_model(dtype):
    args = ModelArgs(
        architecture="Qwen2ForCausalLM",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=False,
        sliding_window=None,
    )
    torch.manual_seed(0)
    m = LlamaForCausalLM(args).to(dtype)
    m.lm_head.weight = m.embed_tokens.weight
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled_budget", [0.0, 0.1])
@pytest.mark.parametrize("consume", [False, True])
def test_pack_weights_keeps_a_tied_table_and_drops_the_rest(dtype, tiled_budget, consume, monkeypatch):
    monkeypatch.setattr(linear_layout, "TILED_FRACTION", tiled_budget)
    m = _tiny_model(dtype)
    plain = {n: l.weight.detach().clone() for n, l in m.named_modules() if isinstance(l, Linear)}
    h = torch.randn(20, 64).to(dtype)
    before = m.layers[0].mlp.gate_up_proj(h)
    if dtype == torch.bfloat16 and TILE_ONLY:  # every layer to the tiled layout alone, the tied table too
        assert pack_weights(m, consume=consume) == len(plain) == 9
        for n, l in m.named_modules():
            if isinstance(l, Linear):
                assert l.weight is None and l.packed is None and l.kernel_rows > 1 << 40
                assert torch.equal(l.tiled, bf16_gemv.tile_weight(plain[n])) and torch.equal(
                    l.dense_weight(), plain[n]
                )
        assert isinstance(m.embed_tokens, TiledEmbedding) and m.embed_tokens.tiled is m.lm_head.tiled
        ids = torch.tensor([[0, 5, 99], [3, 3, 1]])
        assert torch.equal(m.embed_tokens(ids), plain["lm_head"][ids])
        ref = h.double() @ plain["layers.0.mlp.gate_up_proj"].double().T
        assert (m.layers[0].mlp.gate_up_proj(h).double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert pack_weights(m) == 0
        return
    if (
        dtype == torch.bfloat16 and AMX
    ):  # every layer to AMX's layout alone, the tied table too, whatever the budget
        assert pack_weights(m, consume=consume) == len(plain) == 9
        for n, l in m.named_modules():
            if isinstance(l, Linear):
                assert l.weight is None and l.packed is None and l.tiled is None
                assert torch.equal(l.amx, amx_gemm.pack(plain[n], pairs=l.amx_pairs))  # gate/up: in pairs
                assert torch.equal(l.dense_weight(), plain[n])
        assert isinstance(m.embed_tokens, TiledEmbedding) and m.embed_tokens.tiled is m.lm_head.amx
        ids = torch.tensor([[0, 5, 99], [3, 3, 1]])
        assert torch.equal(m.embed_tokens(ids), plain["lm_head"][ids])
        with pytest.raises(IndexError, match="out of range"):
            m.embed_tokens(torch.tensor([300]))
        after = m.layers[0].mlp.gate_up_proj(h)
        ref = h.double() @ plain["layers.0.mlp.gate_up_proj"].double().T
        assert (after.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert pack_weights(m) == 0
        return
    if dtype == torch.bfloat16 and not BF16_PACKS:  # a CPU without oneDNN bf16 or our kernel: nothing to pack
        assert pack_weights(m) == 0
        assert all(
            l.packed is None and torch.equal(l.weight, plain[n])
            for n, l in m.named_modules()
            if isinstance(l, Linear)
        )
        return
    assert pack_weights(m, consume=consume) == len(plain) == 9  # 4 per layer + lm_head
    # bf16 copies in our kernel's tiled layout where it runs and they fit the budget (this model: a few KB);
    # no layer but the tied head keeps its plain weight, and that one only where no tiled copies are made
    tiled = dtype == torch.bfloat16 and bf16_gemv.available() and tiled_budget > 0
    for n, l in m.named_modules():
        if isinstance(l, Linear):
            assert l.packed is not None and torch.equal(l.dense_weight(), plain[n])
            assert (l.weight is not None) == (n == "lm_head" and not tiled)
            assert (l.tiled is not None) == tiled
            if l.tiled is not None:
                assert torch.equal(l.tiled, bf16_gemv.tile_weight(plain[n]))
    ids = torch.tensor([[0, 5, 99], [3, 3, 1]])
    if tiled:  # the tied table went to the tiled layout: one copy for the head and the lookups
        assert isinstance(m.embed_tokens, TiledEmbedding) and m.embed_tokens.tiled is m.lm_head.tiled
        with pytest.raises(IndexError, match="out of range"):
            m.embed_tokens(torch.tensor([300]))
        with pytest.raises(IndexError, match="out of range"):
            m.embed_tokens(torch.tensor([-1]))
    else:
        assert m.lm_head.weight is m.embed_tokens.weight  # the embedding still reads its table
    assert torch.equal(m.embed_tokens(ids), plain["lm_head"][ids])
    assert pack_weights(m) == 0
    after = m.layers[0].mlp.gate_up_proj(h)
    assert torch.allclose(after.float(), before.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 0)


def test_tied_bf16_head_takes_our_kernel_for_small_batches_only(monkeypatch):
    m = _tiny_model(torch.bfloat16)
    table = m.embed_tokens.weight.detach().clone()
    pack_weights(m)
    calls = []
    if AMX:  # the table in AMX's layout alone: every batch size takes that kernel
        real_amx = amx_gemm.AmxLayer.__call__
        monkeypatch.setattr(
            amx_gemm.AmxLayer,
            "__call__",
            lambda self, x, *a, **k: calls.append(x.shape[0]) or real_amx(self, x, *a, **k),
        )
        for rows in (1, 17, 300):
            h = torch.randn(rows, 64).bfloat16()
            ref = h.double() @ table.double().T
            assert (m.compute_logits(h).double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        assert calls == [1, 17, 300] and m.lm_head.packed is None and m.lm_head.tiled is None
        return
    monkeypatch.setattr(
        bf16_gemv,
        "bf16_matmul",
        lambda *a, real=bf16_gemv.bf16_matmul: calls.append(a[0].shape[0]) or real(*a),
    )
    real_call = bf16_gemv.TiledLayer.__call__  # the tied table is tiled where the kernel runs
    monkeypatch.setattr(
        bf16_gemv.TiledLayer,
        "__call__",
        lambda self, x, *a: calls.append(x.shape[0]) or real_call(self, x, *a),
    )
    limit = m.lm_head.kernel_rows  # measured at pack time, within 1..MAX_ROWS; every size without oneDNN bf16
    assert limit > 1 << 40 if TILE_ONLY else 1 <= limit <= bf16_gemv.MAX_ROWS
    sizes = (1, 40, 300) if TILE_ONLY else (1, limit, limit + 1, 40)
    for rows in sizes:
        h = torch.randn(rows, 64).bfloat16()
        logits = m.compute_logits(h)
        ref = h.double() @ table.double().T
        assert (logits.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # The larger batches ran on the packed copy (or F.linear); without our kernel none ran on it.
    if TILE_ONLY:
        assert calls == list(sizes)
    else:
        assert calls == (
            [1, limit] if bf16_gemv.available() and limit > 1 else [1] if bf16_gemv.available() else []
        )


@pytest.mark.skipif(not can_pack(torch.zeros(4, 64)), reason="needs oneDNN and our CPU kernels")
def test_tied_float32_head_takes_our_kernel_for_few_rows_only(monkeypatch):
    m = _tiny_model(torch.float32)
    table = m.embed_tokens.weight.detach().clone()
    pack_weights(m)
    assert m.lm_head.packed is not None and m.lm_head.weight is m.embed_tokens.weight  # the one plain copy
    calls = []
    monkeypatch.setattr(
        f32_gemv,
        "f32_matmul",
        lambda x, *a, real=f32_gemv.f32_matmul: calls.append(x.shape[0]) or real(x, *a),
    )
    limit = linear_mod.F32_KERNEL_ROWS
    for rows in (1, 3, limit, limit + 1, 40):
        h = torch.randn(rows, 64)
        ref = h.double() @ table.double().T
        assert (m.compute_logits(h).double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert calls == ([1, 3, limit] if f32_gemv.available() else [])
    h = torch.randn(2, 3, 64)  # a 3-d batch keeps its shape
    assert m.lm_head(h).shape == (2, 3, m.lm_head.out_features) and calls[-1] == 6


def test_load_model_packs_on_cpu_unless_asked_not_to(demo_dir):
    from sidecar.model.loader import load_model
    from sidecar.model.quant_checkpoint import save_quantized

    packed = load_model(EngineConfig(model="demo", demo_dir=str(demo_dir), dtype="float32"))
    plain = load_model(EngineConfig(model="demo", demo_dir=str(demo_dir), dtype="float32"), pack=False)
    lp, lq = packed.model.layers[0].mlp.down_proj, plain.model.layers[0].mlp.down_proj
    assert lp.weight is None and lp.packed is not None and lq.weight is not None and lq.packed is None
    assert torch.equal(lp.dense_weight(), lq.weight)
    with pytest.raises(ValueError, match="pack=False"):
        save_quantized(packed.model, None, None, "/nonexistent", "int8")


def test_no_tiled_copy_where_our_kernel_cannot_read_it(monkeypatch):
    monkeypatch.setattr(linear_layout, "TILED_FRACTION", 0.1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(Linear(64, 32), Linear(48, 32)).to(
        torch.bfloat16
    )  # rows of 64 and of 48 elements
    ref = [l.weight.detach().clone() for l in m]
    if TILE_ONLY:  # the 64-wide layer to the tiled layout alone; the 48-wide one stays plain for F.linear
        assert pack_weights(m) == 1
        assert m[0].weight is None and m[0].tiled is not None and m[1].tiled is None and m[1].packed is None
        x = torch.randn(3, 48).bfloat16()
        with torch.inference_mode():
            assert torch.equal(m[1](x), torch.nn.functional.linear(x, ref[1], m[1].bias))
        return
    if not BF16_PACKS:
        assert pack_weights(m) == 0
        return
    assert pack_weights(m) == 2
    assert all(torch.equal(l.dense_weight(), r) for l, r in zip(m, ref))
    # A row of 48 elements is not whole 32-element chunks: the kernel never reads that layer, so only the
    # packed copy is held; the 64-wide layer gets a tiled copy where the kernel runs.
    assert m[1].weight is None and m[1].tiled is None and m[1].amx is None and m[0].weight is None
    assert (m[0].tiled is not None) == (bf16_gemv.available() and not AMX)  # with AMX: its layout alone
    assert (m[0].amx is not None) == AMX and (m[0].packed is None) == AMX
    x = torch.randn(3, 48).bfloat16()
    with torch.inference_mode():
        assert torch.equal(m[1](x), torch.nn.functional.linear(x, ref[1], m[1].bias))


def test_mlp_takes_silu_from_the_gate_up_kernel_where_it_offers_it():
    """On a CPU with AMX the MLP's gate/up projection is held in pairs and gives silu(gate) * up in one pass: the same
    bits as the projection then norm_act.silu_mul. A hook on the projection (an adapter's delta) turns it off, so the
    delta joins before the activation, unless the hook says it is idle (LoRA's outside a batch with adapter rows).
    Elsewhere the projection offers nothing and the MLP runs the two steps."""
    from sidecar.model.kernels.cpu import norm_act

    m = _tiny_model(torch.bfloat16)
    pack_weights(m)
    mlp = m.layers[0].mlp
    x = torch.randn(21, 64).bfloat16()
    with torch.inference_mode():
        two_steps = mlp.down_proj(norm_act.silu_mul(mlp.gate_up_proj(x)))
        fused = mlp.gate_up_proj.silu_mul(x)
        assert (fused is not None) == AMX and mlp.gate_up_proj.amx_pairs == (96 if AMX else 0)
        assert torch.equal(mlp(x), two_steps)
        active = [False]

        def hook(mod, inp, out):
            return out * 2 if active[0] else None

        hook.idle = lambda: not active[0]
        handle = mlp.gate_up_proj.register_forward_hook(hook)
        try:
            assert (mlp.gate_up_proj.silu_mul(x) is not None) == AMX  # idle: the one pass stays
            assert torch.equal(mlp(x), two_steps)
            active[0] = True
            assert mlp.gate_up_proj.silu_mul(x) is None
            assert torch.equal(mlp(x), mlp.down_proj(norm_act.silu_mul(mlp.gate_up_proj(x))))
            assert not torch.equal(mlp(x), two_steps)
        finally:
            handle.remove()


def test_logits_come_widened_from_the_head_kernel_where_it_offers_it():
    """On a CPU with AMX a bf16 head writes float32 logits holding its bf16 values in one pass: the bits of
    ``lm_head(h).float()``. A hook on the head turns it off (the hook sees the bf16 output); elsewhere the head offers
    nothing and the logits are the widened bf16 output."""
    m = _tiny_model(torch.bfloat16)
    pack_weights(m)
    h = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        two_steps = m.lm_head(h).float()
        widened = m.lm_head.float_forward(h)
        assert (widened is not None) == AMX
        logits = m.compute_logits(h)
        assert logits.dtype == torch.float32 and torch.equal(logits, two_steps)
        handle = m.lm_head.register_forward_hook(lambda mod, inp, out: out * 2)
        try:
            assert m.lm_head.float_forward(h) is None
            assert torch.equal(m.compute_logits(h), (two_steps.bfloat16() * 2).float())
        finally:
            handle.remove()


def test_the_tile_layout_serves_the_model(tile_build):
    """Where the tile-layout kernel runs -- with AMX, and with AVX-512 BF16 and no AMX (AMD Zen 4/5: the build without
    AMX here) -- every bf16 layer of a model is held in that layout alone (no oneDNN copy, no tiled one, the tied table
    too) for every batch size: F.linear's values to one bf16 rounding, a row alone its bits in the batch, the MLP's
    silu and the head's widened logits from the kernel, the embedding lookups from the head's layout. Where it does
    not run, the layers keep the other layouts."""
    from sidecar.model.kernels.cpu import norm_act

    m = _tiny_model(torch.bfloat16)
    lins = {name: mod for name, mod in m.named_modules() if isinstance(mod, Linear)}
    plain = {
        name: (mod.weight.detach().clone(), None if mod.bias is None else mod.bias.detach().clone())
        for name, mod in lins.items()
    }
    table = m.embed_tokens.weight.detach().clone()
    pack_weights(m)
    if not tile_build:
        assert all(mod.amx is None for mod in lins.values())
        return
    assert all(
        mod.amx is not None and mod.packed is None and mod.tiled is None and mod.weight is None
        for mod in lins.values()
    )
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(m.embed_tokens(ids), table[ids])
    torch.manual_seed(1)
    with torch.inference_mode():
        for name, mod in lins.items():
            w, b = plain[name]
            x = torch.randn(70, w.shape[1]).bfloat16()
            y = mod(x)
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            assert y.dtype == torch.bfloat16 and (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
            for rows in (slice(0, 1), slice(33, 34), slice(5, 38)):
                assert torch.equal(mod(x[rows]), y[rows])
        mlp = m.layers[0].mlp
        x = torch.randn(21, 64).bfloat16()
        assert torch.equal(mlp.gate_up_proj.silu_mul(x), norm_act.silu_mul(mlp.gate_up_proj(x)))
        h = torch.randn(9, 64).bfloat16()
        assert torch.equal(m.lm_head.float_forward(h), m.lm_head(h).float())
