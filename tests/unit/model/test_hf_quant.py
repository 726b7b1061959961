"""Hub-quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) on our int4/int8 modules:
the converted codes dequantize to the tool's weights bit for bit, greedy float32 decoding equals HF
transformers running the dequantized weights, memory stays near the file size, bad configs name the field."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model import hf_quant, hf_quant_formats
from sidecar.model.hf_quant import ConcatLinear, OffsetLinear, PermutedLinear
from sidecar.model.linear import Linear
from sidecar.model.loader import load_model
from sidecar.model.quant import Int4Linear, Int8Linear, QuantEmbedding
from sidecar.model.quant_format import dequantize_int4

from sidecar.bench import hub_pack as H

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8]]


def _gptq(
    bits=4, group_size=32, sym=False, v1=True, act_order=False, shared_order=True, exact=True, narrow=False
):
    """A GPTQ layer writer; with ``act_order`` the groups follow a random column order (one per input
    width when ``shared_order``, as GPTQ's order by the shared inputs' Hessian gives q/k/v and gate/up)."""
    orders: dict = {}

    def layer(name, w):
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // gs
        if act_order:
            key = k if shared_order else name
            perm = orders.setdefault(
                key, torch.randperm(k, generator=torch.Generator().manual_seed(len(orders)))
            )
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // gs
        codes, s, z = H.quantize(w, bits, g_idx, k // gs, sym, exact, narrow)
        t = H.pack_gptq(codes, s, z, g_idx, bits, v1)
        return t, H.dequant_gptq(t, bits, v1)

    qc = dict(quant_method="gptq", bits=bits, group_size=group_size, sym=sym, desc_act=act_order)
    return qc | {"checkpoint_format": "gptq" if v1 else "gptq_v2"}, layer


def _awq(group_size=32, exact=True):
    def layer(name, w):
        k = w.shape[1]
        codes, s, z = H.quantize(w, 4, torch.arange(k) // group_size, k // group_size, False, exact)
        t = H.pack_awq(codes, s, z)
        return t, H.dequant_awq(t, group_size)

    return dict(quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"), layer


def _ct(bits=4, strategy="group", group_size=32, sym=True, exact=True, narrow=False):
    gs = group_size if strategy == "group" else None
    weights = dict(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=gs, dynamic=False)
    qc = dict(
        quant_method="compressed-tensors",
        format="pack-quantized",
        quantization_status="compressed",
        config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None)},
        ignore=["lm_head"],
    )
    return qc, lambda name, w: H.pack_ct(w, bits, strategy, gs, sym, exact, narrow)


def _hf_greedy(src_dir, ref: dict, n: int) -> list[list[int]]:
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(str(src_dir))
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.load_state_dict(ref, strict=False)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            g = hf.generate(
                torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


C = "compressed-tensors"
# case -> (family, (quantization_config, layer writer), reported format, module kind of qkv_proj)
CASES = {
    "gptq-asym-v1-g32": ("llama", _gptq(), "gptq-int4", Int4Linear),
    "gptq-sym-actorder-g32": ("llama", _gptq(sym=True, act_order=True), "gptq-int4", PermutedLinear),
    "gptq-actorder-parts": ("qwen2", _gptq(act_order=True, shared_order=False), "gptq-int4", ConcatLinear),
    "gptq-int8-perchannel": (
        "qwen2",
        _gptq(bits=8, group_size=-1, sym=True, narrow=True),
        "gptq-int8",
        Int8Linear,
    ),
    # GPTQ's own symmetric 8-bit scale (absmax / 127.5): row minima get code 0, -128 after the zero point
    "gptq-int8-sym-code0": (
        "llama",
        _gptq(bits=8, group_size=-1, sym=True, exact=False),
        "gptq-int8",
        Int8Linear,
    ),
    # asymmetric per-channel 8-bit: codes over the whole 0..255 with zero points off 128 (int8 codes shifted
    # to fit, the zero point's remainder a per-row offset)
    "gptq-int8-asym-perchannel": ("qwen2", _gptq(bits=8, group_size=-1), "gptq-int8", OffsetLinear),
    "awq-g32": ("qwen2", _awq(), "awq-int4", Int4Linear),
    "ct-w4a16-group-sym": ("qwen2", _ct(), f"{C}-w4a16", Int4Linear),
    "ct-w4a16-channel-asym": ("llama", _ct(strategy="channel", sym=False), f"{C}-w4a16", Int4Linear),
    "ct-w8a16-channel": ("llama", _ct(bits=8, strategy="channel", narrow=True), f"{C}-w8a16", Int8Linear),
    "ct-w8a16-channel-asym": (
        "llama",
        _ct(bits=8, strategy="channel", sym=False),
        f"{C}-w8a16",
        OffsetLinear,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_on_the_dequantized_weights(tiny_models, tmp_path, case):
    kind, (qc, layer), label, qkv_cls = CASES[case]
    out = tmp_path / "q"
    ref = H.write(tiny_models[kind], out, qc, layer)
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=64, quantize_lm_head="none")
    loaded = llm.engine.loaded
    assert loaded.quantization == label and llm.engine.model_info["quantization"] == label
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, qkv_cls)
    int8 = label.endswith(("int8", "w8a16"))
    inner = loaded.model.layers[1].mlp.down_proj
    while isinstance(inner, (PermutedLinear, OffsetLinear)):
        inner = inner.inner
    assert isinstance(inner, Int8Linear if int8 else Int4Linear)
    # with quantize_lm_head none, lm_head and the embedding stay as the tool left them (full precision)
    assert isinstance(loaded.model.lm_head, torch.nn.Linear)
    assert llm.engine.model_info["lm_head"] == "float32"
    expect = _hf_greedy(tiny_models[kind], ref, 8)
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == expect


@pytest.mark.parametrize(
    "kind,setting,head_cls",
    [
        ("llama", "auto", Int8Linear),
        ("qwen2", "auto", Int8Linear),
        ("qwen2", "same", Int4Linear),
        ("llama", "none", Linear),
    ],
)
def test_the_float_head_of_a_4_bit_file_follows_quantize_lm_head_as_our_int4_does(
    tiny_models, tmp_path, kind, setting, head_cls
):
    """The tool's full-precision head (a tied embedding with it) takes the head mode our own int4 weights get
    for the same setting: int8 by default; greedy equals HF running the dequantized weights and that head."""
    out = tmp_path / "q"
    ref = H.write(tiny_models[kind], out, *_gptq())
    kw = dict(quantize_lm_head=setting, quant_group_size=32)  # (an int4 head's group size)
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=64, **kw)
    model, info = llm.engine.loaded.model, llm.engine.model_info
    assert type(model.lm_head) is head_cls and info["quantization"] == "gptq-int4"
    assert info["lm_head"] == getattr(head_cls, "mode", "float32")
    tied = kind == "qwen2"
    assert isinstance(
        model.embed_tokens, QuantEmbedding if tied and setting != "none" else torch.nn.Embedding
    )
    if head_cls is Int8Linear:
        head = model.lm_head
        w = head.weight[:, : head.in_features].float() * head.scales_f32[:, None]
        key = "model.embed_tokens.weight" if tied else "lm_head.weight"
        assert not torch.equal(w, ref[key])  # the reference really takes the quantized head
        ref = dict(ref, **{key: w, "lm_head.weight": w})
    if head_cls is not Int4Linear:  # (an int4 head: its kind is the check; the int4 greedy cases run above)
        got = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in got] == _hf_greedy(tiny_models[kind], ref, 8)


def test_a_quantized_lm_head_runs_int4_and_greedy_equals_hf(tiny_models, tmp_path):
    """GPTQ with lm_head quantized too (an untied head whose vocab is not a whole number of zeros words)."""
    out = tmp_path / "q"
    ref = H.write(tiny_models["llama"], out, *_gptq(), lm_head=True)
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=64)
    assert isinstance(llm.engine.loaded.model.lm_head, Int4Linear)
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == _hf_greedy(tiny_models["llama"], ref, 8)


def test_a_full_precision_head_asked_of_a_quantized_file_head_is_refused_naming_the_setting(
    tiny_models, tmp_path
):
    """The file's int4 lm_head has no full-precision weights to keep: ``none`` is refused, not ignored."""
    out = tmp_path / "q"
    H.write(tiny_models["llama"], out, *_gptq(), lm_head=True)
    with pytest.raises(
        ValueError, match=r"quantize_lm_head: none keeps the head in full precision.*gptq-int4"
    ):
        load_model(EngineConfig(model=str(out), dtype="float32", quantize_lm_head="none"))
    for setting in ("auto", "same"):  # the file's own head, as it is
        cfg = EngineConfig(model=str(out), dtype="float32", quantize_lm_head=setting)
        assert isinstance(load_model(cfg, pack=False).model.lm_head, Int4Linear)


@pytest.mark.parametrize(
    "case",
    ["gptq-asym-v1-g32", "gptq-sym-actorder-g32", "gptq-v2-perchannel", "awq-g64", "ct-w4a16-channel-asym"],
)
def test_int4_operands_dequantize_to_the_tools_weights_bit_for_bit(case):
    """With the tools' own fp16 scales (not the greedy tests' short ones): our stored int4 form, permuted
    back, is the tool's dequantized weight exactly."""
    qc, layer = {
        "gptq-asym-v1-g32": _gptq(exact=False),
        "gptq-sym-actorder-g32": _gptq(sym=True, act_order=True, exact=False),
        "gptq-v2-perchannel": _gptq(group_size=-1, v1=False, act_order=True, exact=False),
        "awq-g64": _awq(group_size=64, exact=False),
        "ct-w4a16-channel-asym": _ct(strategy="channel", sym=False, exact=False),
    }[case]
    w = torch.randn(48, 192, generator=torch.Generator().manual_seed(1))
    w[:, :64] = w[:, :64].abs()  # groups without negative weights: zero point 0 (GPTQ v1 stores it as -1)
    tensors, back = layer("x.q_proj", w)
    scheme = hf_quant.parse_quant_config(qc)
    read = scheme.make.args[1]
    src = read(
        lambda key: tensors[key.split(".", 2)[-1]],
        lambda key: key.split(".", 2)[-1] in tensors,
        "x.q_proj",
        192,
    )
    assert torch.equal(src.dequantize(), back)
    q, s, z, perm = hf_quant_formats.int4_operands(src, "x.q_proj")
    w_ours = dequantize_int4(q, s, z, 192)
    if perm is not None:
        w_ours = w_ours[:, torch.argsort(perm)]
    assert torch.equal(w_ours, back)
    if case.startswith("ct"):
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        tool = unpack_from_int32(tensors["weight_packed"], 4, torch.Size([48, 192])).to(torch.int16) + 8
        assert torch.equal(src.codes.to(torch.int16), tool)
        # Zero points stored unpacked (signed int8 codes) read the same as the packed ones.
        zp = unpack_from_int32(tensors["weight_zero_point"], 4, torch.Size([48, 1]), packed_dim=0)
        plain = dict(tensors, weight_zero_point=zp)
        src8 = read(
            lambda key: plain[key.split(".", 2)[-1]],
            lambda key: key.split(".", 2)[-1] in plain,
            "x.q_proj",
            192,
        )
        assert torch.equal(src8.dequantize(), back)


def test_per_channel_scales_over_a_width_off_the_kernel_alignment_pad_exactly():
    """in_features 80 (not a multiple of 32): the codes are padded to 96 and the per-channel scale repeated
    over the kernel's groups (fp16 scales, as files store them: the products are exact in float32); the padded
    columns meet zero activations."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (24, 80), generator=g, dtype=torch.uint8)
    src = hf_quant_formats.Source(
        codes, (torch.rand(24, 1, generator=g) + 0.1).half().float(), torch.full((24, 1), 5.0), None, 4
    )
    q, s, z, perm = hf_quant_formats.int4_operands(src, "x")
    assert perm is None and q.shape == (24, 48) and s.shape == (24, 3)
    assert torch.equal(dequantize_int4(q, s, z, 80), src.dequantize())


def test_resident_weight_bytes_stay_near_the_file_size(tiny_models, tmp_path):
    """The int4 modules' buffers against the file's quantized tensors (qweight, qzeros, scales, g_idx), and
    the whole model's parameters and buffers against the file with its float tensors counted as bf16."""
    from safetensors import safe_open

    out = tmp_path / "q"
    H.write(tiny_models["llama"], out, *_gptq(exact=False))
    model = load_model(EngineConfig(model=str(out), dtype="bfloat16")).model
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * len(model.layers)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    packed = nbytes(
        t for k, t in stored.items() if k.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")
    )
    assert nbytes(b for m in int4 for b in m.buffers()) <= 1.15 * packed
    file_bytes = sum(
        t.numel() * (2 if t.dtype == torch.float32 else t.element_size()) for t in stored.values()
    )
    assert nbytes(list(model.parameters()) + list(model.buffers())) <= 1.15 * file_bytes


@pytest.mark.parametrize(
    "change,field",
    [
        ({"bits": 3}, "quantization_config.bits: 3 is not supported"),
        ({"group_size": 16}, "quantization_config.group_size: 16 is not supported"),
        (
            {"quant_method": "bitsandbytes"},
            "quantization_config.quant_method: 'bitsandbytes' is not supported",
        ),
        ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format: 'marlin' is not supported"),
        ({"desc_act": "yes"}, "quantization_config.desc_act"),
        ({"bits": 8}, "quantization_config.bits: 8 with group_size 32 is not supported"),
    ],
)
def test_malformed_quantization_config_names_the_field(tiny_models, tmp_path, change, field):
    out = tmp_path / "q"
    qc, layer = _gptq()
    H.write(tiny_models["llama"], out, qc | change, layer)
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")):
        load_model(EngineConfig(model=str(out), dtype="float32"))


@pytest.mark.parametrize(
    "qc,field",
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
            "quantization_config.version",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {}}},
            },
            "quantization_config.format",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 2}}},
            },
            "quantization_config.config_groups.g.weights.num_bits",
        ),
        ([], "quantization_config: must be an object"),
        (
            _ct(bits=8, group_size=64)[0],
            "quantization_config.config_groups.group_0.weights.num_bits: 8 with group_size 64 is not",
        ),
        (
            {"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24-bitmask"}},
            "quantization_config.sparsity_config: 'sparse-24-bitmask' is not supported",
        ),
    ],
)
def test_other_refusals_name_the_field(qc, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        hf_quant.parse_quant_config(qc)


def test_quantization_on_top_of_a_quantized_checkpoint_is_refused(tiny_models, tmp_path):
    out = tmp_path / "q"
    H.write(tiny_models["llama"], out, *_gptq())
    with pytest.raises(ValueError, match="quantization: the checkpoint is already quantized \\(gptq-int4\\)"):
        load_model(EngineConfig(model=str(out), dtype="float32", quantization="int4"))


def test_self_check_refuses_a_wrong_layout_and_runs_the_layers_dense(
    tiny_models, tmp_path, monkeypatch, caplog
):
    """A conversion that got the layout wrong (nibbles swapped) is caught at start-up: logged, and the
    layers of that kind run the dequantized weights instead, still equal to HF."""
    real = hf_quant.int4_operands

    def swapped(src, name):
        q, s, z, perm = real(src, name)
        return (q << 4) | (q >> 4), s, z, perm

    monkeypatch.setattr(hf_quant, "int4_operands", swapped)
    out = tmp_path / "q"
    ref = H.write(tiny_models["llama"], out, *_gptq())
    with caplog.at_level(logging.WARNING, logger="sidecar.model"):
        loaded = load_model(EngineConfig(model=str(out), dtype="float32"), pack=False)
    assert "gptq-int4 layers run dense: off from the dequantized reference" in caplog.text
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    w = torch.cat([ref[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert isinstance(qkv, torch.nn.Linear) and torch.equal(qkv.weight, w)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4


def test_int8_code_zero_of_a_symmetric_file_loads_as_minus_128_exactly(tiny_models, tmp_path):
    """A symmetric GPTQ 8-bit file whose rows reach code 0: our int8 codes times their scales are the tool's
    dequantized weights bit for bit, -128 included (greedy equality: the gptq-int8-sym-code0 case)."""
    out = tmp_path / "q"
    ref = H.write(tiny_models["llama"], out, *_gptq(bits=8, group_size=-1, sym=True, exact=False))
    model = load_model(EngineConfig(model=str(out), dtype="float32", quantize_lm_head="none")).model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and int((qkv.weight == -128).sum()) > 0
    w = torch.cat([ref[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv.weight[:, : w.shape[1]].float() * qkv.scales_f32[:, None], w)


def test_asymmetric_8_bit_rows_keep_their_zero_point_where_it_fits_else_shift_with_an_offset():
    """Row 0 spans every code 0..255 with zero point 100 (u - 100 leaves int8): its codes are u - 128 and the
    zero point's remainder (128 - 100) * s its offset; row 1 spans 10..200 with zero point 90, which fits:
    codes u - 90, offset 0. Codes times scales plus offsets are the tool's weight exactly (fp16 scales)."""
    u = torch.stack([torch.arange(256), torch.arange(256) % 191 + 10]).to(torch.uint8)
    s = torch.tensor([[0.013], [0.2]]).half().float()
    src = hf_quant_formats.Source(u, s, torch.tensor([[100.0], [90.0]]), None, 8)
    codes, scales, perm, offsets = hf_quant_formats.int8_operands(src, "x")
    assert perm is None and torch.equal(scales, s[:, 0])
    assert torch.equal(codes.long(), u.long() - torch.tensor([[128], [90]]))
    assert torch.equal(offsets, torch.stack([28 * s[0, 0], torch.tensor(0.0)]))
    assert torch.equal(codes.float() * scales[:, None] + offsets[:, None], src.dequantize())
    # symmetric rows (zero 128) need no offset at all
    sym = hf_quant_formats.Source(u[:1], s[:1], torch.tensor([[128.0]]), None, 8)
    assert hf_quant_formats.int8_operands(sym, "x")[3] is None


@pytest.mark.parametrize("case", ["ct-w4a16", "gptq-int4"])
def test_quantized_mixtral_experts_run_int4_and_greedy_equals_hf(tmp_path, demo_dir, case):
    """Every expert quantized by the tool, the router left in full precision: the experts run as int4 layers
    over their codes, and greedy float32 equals HF transformers loading the dequantized weights."""
    import shutil

    import transformers as tf
    from safetensors.torch import save_file

    from tests.unit.engine.test_engine_vs_hf import hf_generate
    from tests.unit.model.family_checkpoints import build_family_checkpoint

    src = build_family_checkpoint("mixtral", tmp_path / "f", demo_dir)
    out, deq = tmp_path / "q", tmp_path / "deq"
    ref = H.write(src, out, *(_ct() if case == "ct-w4a16" else _gptq()))
    shutil.copytree(src, deq)
    save_file({k: v.contiguous() for k, v in ref.items()}, str(deq / "model.safetensors"))
    llm = LLM(model=str(out), dtype="float32", num_kv_blocks=64, quantize_lm_head="none")
    moe = llm.engine.loaded.model.layers[0].mlp
    assert all(isinstance(m, Int4Linear) for e in moe.experts for m in (e.gate_up_proj, e.down_proj))
    assert type(moe.gate) is Linear and llm.engine.loaded.quantization.endswith(("int4", "w4a16"))
    expect = hf_generate(tf.AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32), PROMPTS, 8)
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == expect


def test_quantized_experts_with_biases_are_refused_naming_the_config(tmp_path, demo_dir):
    """gpt-oss's biased experts (and blocks with shared or grouped experts) do not take hub 4-bit codes."""
    from tests.unit.model.family_checkpoints import build_family_checkpoint

    out = build_family_checkpoint("gpt_oss", tmp_path / "moe", demo_dir)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = _gptq()[0]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config: gptq-int4 experts of GptOss"):
        load_model(EngineConfig(model=str(out), dtype="float32"))
