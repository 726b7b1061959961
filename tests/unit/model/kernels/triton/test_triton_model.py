"""The decoder with every Triton path on (CPU tensors, Triton's interpreter) against the same decoder with
every path off: the same logits within float32 noise and the same greedy tokens, full precision and
quantized, directly and through the engine."""

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.loader import load_model
from sidecar.model.quant import Int4Linear, Int8Linear

KERNEL_PATHS = ("attention", "rope_kv", "norm", "silu_mul", "gemv", "weight_only")


def _set(paths: FastPaths, on: bool) -> None:
    for name in KERNEL_PATHS:
        setattr(paths, name, on)


def _run(model, device, bs=4, steps=3, one_row=True):
    """Two prompts prefilled in one step, then batched decode steps, then (``one_row``) a step of the first
    alone; returns every step's logits, one row a sequence."""
    args = model.args
    kv = [
        (
            torch.zeros(10, bs, args.num_kv_heads, args.head_dim, device=device, dtype=model.rope_cos.dtype),
            torch.zeros(10, bs, args.num_kv_heads, args.head_dim, device=device, dtype=model.rope_cos.dtype),
        )
        for _ in model.layers
    ]
    tables = [[1, 2, 3, 4], [5, 6, 0, 0]]  # 4 and 2 blocks: room for 10 + steps and 3 + steps tokens
    lens = [10, 3]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, args.vocab_size, (n,), generator=g).tolist() for n in lens]

    def slot(r, p):
        return tables[r][p // bs] * bs + p % bs

    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    ids = seqs[0] + seqs[1]
    pos = list(range(lens[0])) + list(range(lens[1]))
    slots = [slot(0, p) for p in range(lens[0])] + [slot(1, p) for p in range(lens[1])]
    segs = [
        PrefillSegment(0, lens[0], lens[0], t(tables[0])),
        PrefillSegment(lens[0], lens[1], lens[1], t(tables[1])),
    ]
    meta = AttentionMetadata(slot_mapping=t(slots), block_size=bs, prefills=segs)
    logits = []
    with torch.no_grad():
        h = model(t(ids), t(pos), kv, meta)
        out = model.compute_logits(h[[lens[0] - 1, sum(lens) - 1]])
        for _ in range(steps):
            logits.append(out)
            nxt = out.argmax(-1).tolist()
            for r in range(2):
                seqs[r].append(nxt[r])
            p = [len(s) - 1 for s in seqs]
            meta = AttentionMetadata(
                slot_mapping=t([slot(r, p[r]) for r in range(2)]),
                block_size=bs,
                decode_block_tables=t(tables),
                decode_ctx_lens=t([x + 1 for x in p]),
            )
            out = model.compute_logits(model(t(nxt), t(p), kv, meta))
        if (
            one_row
        ):  # the last batched step's logits, then the first sequence alone (the fused products' path)
            logits.append(out)
            nxt, p = out[0].argmax(-1).item(), len(seqs[0])
            meta = AttentionMetadata(
                slot_mapping=t([slot(0, p)]),
                block_size=bs,
                decode_block_tables=t(tables[:1]),
                decode_ctx_lens=t([p + 1]),
            )
            logits.append(model.compute_logits(model(t([nxt]), t([p]), kv, meta)))
    return torch.cat(logits)


def _spy(monkeypatch, module, name, calls):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))


@pytest.mark.parametrize("kind,quant", [("llama", None), ("qwen2", "int8"), ("llama", "int4")])
def test_model_with_triton_paths_matches_paths_off(tiny_models, kind, quant, device, monkeypatch):
    from sidecar.model import quant as quant_layers
    from sidecar.model.kernels.triton import (
        attention as triton_attention,
        gemv as triton_gemv,
        ops as triton_ops,
        wo as triton_wo,
    )

    monkeypatch.setattr(quant_layers, "PLAIN_INT4_ON_CPU", True)  # as every int4 layer on CUDA does
    cfg = EngineConfig(
        model=str(tiny_models[kind]),
        dtype="float32",
        device=device.type,
        quantization=quant,
        quant_group_size=32,
    )
    model = load_model(cfg, pack=False).model  # plain weights, as on CUDA
    layer = model.layers[0]
    # One switchboard, shared by every layer and every quantized linear.
    assert (
        layer.input_layernorm.fast_paths is model.fast_paths
        and layer.self_attn.fast_paths is model.fast_paths
    )
    assert model.fast_paths.active() == []
    if quant:
        assert isinstance(layer.mlp.down_proj, (Int8Linear, Int4Linear))
        assert layer.mlp.down_proj.fast_paths is model.fast_paths
    one_row = not quant  # quantized layers do not take the fused products: their comparison as before
    ref = _run(model, device, one_row=one_row)
    calls = []
    for mod, name in (
        (triton_attention, "paged_decode_attention"),
        (triton_ops, "rope_store_kv"),
        (triton_ops, "add_rms_norm"),
        (triton_ops, "silu_mul"),
        (triton_wo, "int8_matmul"),
        (triton_wo, "int4_matmul"),
        (triton_gemv, "norm_matmul"),
        (triton_gemv, "matmul"),
        (triton_gemv, "silu_matmul"),
    ):
        _spy(monkeypatch, mod, name, calls)
    _set(model.fast_paths, True)
    fast = _run(model, device, one_row=one_row)
    expected = {"paged_decode_attention", "rope_store_kv", "add_rms_norm", "silu_mul"}
    if quant:
        expected.add(f"{quant}_matmul")
        expected.add("int8_matmul")  # the head: int8 under int8 and int4 weights (quantize_lm_head "auto")
    else:  # the one-row step: a layer's products with the norms and silu fused in (more rows: the rest)
        expected |= {"norm_matmul", "matmul", "silu_matmul"}
    assert set(calls) == expected  # every path ran
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    # Quantized layers: with the path off, prefill-sized batches run torch's fused CPU kernels on bf16-rounded
    # activations (quant.kernel_dtype); the Triton kernels multiply float32 activations at full precision.
    # On CUDA both paths compute those layers in bf16, rounding at different points: bf16's error, relative.
    if quant and device.type == "cuda":
        assert float((fast - ref).norm() / ref.norm()) < 2e-2
    else:
        tol = 1e-2 if quant else 2e-4
        torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    _set(model.fast_paths, False)
    assert torch.equal(_run(model, device, one_row=one_row), ref)  # off again: today's path, bit for bit


def test_engine_greedy_tokens_unchanged_with_triton_paths(tiny_models, device):
    llm = LLM(
        model=str(tiny_models["qwen2"]), dtype="float32", device=device.type, num_kv_blocks=64, block_size=8
    )
    prompts = ["hello there", "a longer prompt that spans a few blocks of eight tokens"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    _set(llm.engine.runner.model.fast_paths, True)
    fast = [o.token_ids for o in llm.generate(prompts, params)]
    assert fast == ref and all(len(t) == 6 for t in ref)


def test_a_projection_with_a_hook_keeps_it_under_the_fused_path(tiny_models, device, monkeypatch):
    """LoRA adds its update through forward hooks: a layer with one takes the separate kernels, hook and all;
    the other layers still fuse."""
    from sidecar.model.kernels.triton import gemv as triton_gemv

    cfg = EngineConfig(model=str(tiny_models["llama"]), dtype="float32", device=device.type)
    model = load_model(cfg, pack=False).model
    model.layers[0].mlp.down_proj.register_forward_hook(lambda module, inputs, out: out * 0.5)
    ref = _run(model, device)
    calls = []
    _spy(monkeypatch, triton_gemv, "norm_matmul", calls)
    _set(model.fast_paths, True)
    fast = _run(model, device)
    assert len(calls) == 2 * (len(model.layers) - 1)  # the one-row step: every layer but the hooked one
    torch.testing.assert_close(fast, ref, atol=2e-4, rtol=2e-4)


def test_lora_hooks_leave_base_model_steps_to_the_fused_path(tiny_models, device, monkeypatch, tmp_path):
    """With adapter slots the projections carry LoRA's hooks: a step without adapter rows (idle hooks) still takes
    the fused products, a step with them takes the separate kernels and gets the adapter's update."""
    from sidecar.model.kernels.triton import gemv as triton_gemv
    from sidecar.model.lora import LoraLayers, read_adapter
    from tests.unit.model.lora_helpers import ATTN, MLP, make_adapter

    cfg = EngineConfig(model=str(tiny_models["llama"]), dtype="float32", device=device.type)
    model = load_model(cfg, pack=False).model
    lora = LoraLayers(model, max_loras=1, max_rank=4)
    lora.load(
        0,
        read_adapter(
            str(make_adapter(tiny_models["llama"], tmp_path / "a", r=4, targets=ATTN + MLP)), model.args, 4
        ),
    )
    calls = []
    _spy(monkeypatch, triton_gemv, "norm_matmul", calls)
    base = _run(model, device)
    _set(model.fast_paths, True)
    torch.testing.assert_close(_run(model, device), base, atol=2e-4, rtol=2e-4)
    assert len(calls) == 2 * len(model.layers)  # the one-row step, every layer fused
    calls.clear()
    model.register_forward_pre_hook(
        lambda module, args: lora.set_batch([0] * args[0].shape[0])
    )  # every token
    fast = _run(model, device)
    assert calls == []  # adapter rows: the separate kernels, hooks and all
    _set(model.fast_paths, False)
    adapted = _run(model, device)
    assert (
        adapted - base
    ).abs().max() > 1e-2  # the adapter changes the output: the comparison proves something
    torch.testing.assert_close(fast, adapted, atol=2e-4, rtol=2e-4)
