"""GGUF checkpoints: files written here with gguf.GGUFWriter, the way llama.cpp's converter writes them
(Q/K rows interleaved for rotary, tokenizer and chat template in the metadata), load into our decoder
with the dequantized reference weights, and give HF-equal greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.model import gguf_tensors as gt
from sidecar.model.gguf import find_gguf, model_dir_for
from sidecar.model.loader import load_model

gguf = pytest.importorskip("gguf")  # a declared dependency; fails loudly below if absent
Q = gguf.GGMLQuantizationType
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    rope_theta=10000.0,
)
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row interleave (the converter's permutation), applied per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, idx, rest = hf.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{idx}.{GGUF_NAMES[mod]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def _encode(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to write, the float32 weights a reader gets back)."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype == Q.IQ4_NL:  # gguf-py cannot quantize it; the bytes only need the right size
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), w
    data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def write_tiny_gguf(
    path: Path, tokenizer_dir: Path, types, arch: str = "llama", seed: int = 0, tie: bool = False
) -> dict[str, torch.Tensor]:
    """A tiny random Llama written as GGUF; ``types(hf_name)`` picks each 2-D tensor's type.
    Returns the HF state dict a dequantizing reader must recover (float32)."""
    import transformers as tf

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = tf.LlamaConfig(
        **TINY, vocab_size=len(tokens), tie_word_embeddings=tie, eos_token_id=2, bos_token_id=None
    )
    torch.manual_seed(seed)
    hf = tf.LlamaForCausalLM(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ref = {}
    for name, t in hf.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if a.ndim == 1:
            w.add_tensor(_gguf_name(name), a)
            ref[name] = torch.from_numpy(a.copy())
            continue
        heads = (
            {"q_proj": TINY["num_attention_heads"], "k_proj": TINY["num_key_value_heads"]}.get(
                name.split(".")[-2]
            )
            if arch == "llama"
            else None
        )
        stored = _permute(a, heads) if heads else a
        qtype = types(name)
        if qtype == Q.BF16:
            bf = torch.from_numpy(stored.copy()).bfloat16()
            w.add_tensor(_gguf_name(name), bf.view(torch.int16).numpy().view(np.uint8), raw_dtype=Q.BF16)
            ref[name] = torch.from_numpy(a.copy()).bfloat16().float()
            continue
        data, back = _encode(stored, qtype)
        w.add_tensor(_gguf_name(name), data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        if heads:  # undo the interleave on the reference (rows are independent of the K-blocks)
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
        ref[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def _hf_from(ref: dict[str, torch.Tensor], vocab: int, tie: bool = False):
    import transformers as tf

    hf = tf.LlamaForCausalLM(
        tf.LlamaConfig(**TINY, vocab_size=vocab, tie_word_embeddings=tie, eos_token_id=2, bos_token_id=None)
    )
    hf.load_state_dict(ref, strict=not tie)
    return hf.float().eval()


def _hf_greedy(hf, prompts, n):
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = hf.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def _mixed(name: str):
    if "q_proj" in name or "k_proj" in name or "down_proj" in name:
        return Q.Q4_0
    if "v_proj" in name or "o_proj" in name:
        return Q.Q8_0
    if "gate_proj" in name:
        return Q.F16
    if "up_proj" in name:
        return Q.BF16
    return Q.F32


PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [64, 65, 66, 67, 68, 69, 70, 71, 72]]


def test_mixed_types_load_as_dequantized_reference_and_match_hf(tmp_path, demo_dir):
    path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(path, demo_dir, _mixed)
    loaded = load_model(EngineConfig(model=str(path), dtype="float32"))
    m = loaded.model
    layer = m.layers[1]
    qkv = torch.cat([ref[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.dense_weight(), qkv)
    gate_up = torch.cat([ref[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.dense_weight(), gate_up)
    assert torch.equal(layer.mlp.down_proj.dense_weight(), ref["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(m.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(m.lm_head.dense_weight(), ref["lm_head.weight"])
    # Tokenizer and chat template come from the file's metadata.
    tok = loaded.tokenizer
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.eos_token_ids == (2,)
    hf = _hf_from(ref, m.args.vocab_size)
    expect = _hf_greedy(hf, PROMPTS, 10)
    out = LLM(model=str(path), dtype="float32", num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True)
    )
    assert [o.token_ids for o in out] == expect


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_other_block_types_load_as_their_dequantized_weights(tmp_path, demo_dir, qtype):
    path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(path, demo_dir, lambda name: qtype if name.endswith("proj.weight") else Q.F32)
    m = load_model(EngineConfig(model=str(path), dtype="float32")).model
    for i, layer in enumerate(m.layers):
        qkv = torch.cat([ref[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.dense_weight(), qkv)
        assert torch.equal(layer.mlp.down_proj.dense_weight(), ref[f"model.layers.{i}.mlp.down_proj.weight"])


@pytest.mark.parametrize("qtype", [Q.BF16, Q.F32, Q.F16])
def test_float_gguf_greedy_equals_hf(tmp_path, demo_dir, qtype):
    path = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(path, demo_dir, lambda name: qtype, tie=True, seed=1)
    hf = _hf_from(ref, len(ref["model.embed_tokens.weight"]), tie=True)
    expect = _hf_greedy(hf, PROMPTS, 12)
    out = LLM(
        model=str(tmp_path), dtype="float32", num_kv_blocks=64
    ).generate(  # a directory holding one file
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True)
    )
    assert [o.token_ids for o in out] == expect


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_load_as_exact_int4(tmp_path, demo_dir, qtype):
    from sidecar.model.quant import Int4Linear, dequantize_int4

    path = tmp_path / "q4.gguf"
    ref = write_tiny_gguf(path, demo_dir, lambda name: qtype if "layers" in name else Q.F32)
    loaded = load_model(EngineConfig(model=str(path), quantization="int4", dtype="float32"))
    assert loaded.quantization == "int4"
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.group_size == 32
    # The cached checkpoint holds the file's codes: dequantizing them gives the reference bit for bit.
    from safetensors.torch import load_file

    state = load_file(str(loaded.model_dir / "model.safetensors"))
    w = dequantize_int4(
        state["layers.0.self_attn.qkv_proj.qweight"],
        state["layers.0.self_attn.qkv_proj.scales"],
        state["layers.0.self_attn.qkv_proj.zeros"],
        64,
    )
    expect = torch.cat([ref[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.allclose(w, expect, rtol=0, atol=1e-6)
    # The runtime layer computes with those weights (activations and scales rounded to bf16).
    x = torch.randn(3, 64)
    assert torch.allclose(qkv(x), x @ expect.T, rtol=0.05, atol=0.05 * float((x @ expect.T).abs().max()))
    # Without int4 asked and with an explicit dtype the file is dequantized instead.
    fp = load_model(EngineConfig(model=str(path), dtype="float32"))
    assert fp.quantization is None
    assert torch.equal(fp.model.layers[0].self_attn.qkv_proj.dense_weight(), expect)


def test_conversion_is_cached(tmp_path, demo_dir):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, demo_dir, lambda name: Q.F16)
    first = model_dir_for(path, None, "float32")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_dir_for(path, None, "float32") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert str(first).startswith(str(tmp_path / "home"))
    assert find_gguf(str(tmp_path)) == path


def test_unsupported_architecture_and_type_name_the_problem(tmp_path, demo_dir):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        LLM(model=str(path))
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, demo_dir, lambda name: Q.IQ4_NL if "o_proj" in name else Q.F32)
    with pytest.raises(ValueError, match=r"attn_output.weight.*IQ4_NL.*not supported"):
        LLM(model=str(path))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing.gguf"))


def test_unpermute_inverts_the_converter_interleave():
    w = torch.arange(4 * 8 * 3).reshape(32, 3)
    assert torch.equal(gt.unpermute_rows(torch.from_numpy(_permute(w.numpy(), 4)), 4), w)


def test_tied_q8_0_embedding_stays_q8_0_next_to_int4_layers(tmp_path, demo_dir, monkeypatch):
    """A Q4 file whose tied token_embd is Q8_0 (as llama.cpp writes SmolLM2 and Qwen2): the table is kept as
    the file's Q8_0 blocks for both the embedding and lm_head, its values exactly the dequantized file's;
    logits through the grouped int8 kernel equal those of the float table, and so does greedy decoding.
    (Greedy against HF float32 for this form is tests/unit/model/test_default_model.py, on the real model.)"""
    from sidecar.model.kernels.cpu import int8_gemv
    from sidecar.model.q8_0 import Q8_0Embedding, Q8_0Linear, dequantize_g32

    path = tmp_path / "q4q8.gguf"

    def types(name):
        if "layers" in name and name.endswith("proj.weight"):
            return Q.Q4_0
        return Q.Q8_0 if "embed_tokens" in name else Q.F32

    ref = write_tiny_gguf(path, demo_dir, types, tie=True, seed=2)
    loaded = load_model(EngineConfig(model=str(path)))  # dtype auto: the exact int4 form
    m = loaded.model
    assert loaded.quantization == "int4"
    assert isinstance(m.embed_tokens, Q8_0Embedding) and isinstance(m.lm_head, Q8_0Linear)
    assert m.lm_head.weight is m.embed_tokens.weight  # one table
    table = ref["model.embed_tokens.weight"]
    assert torch.equal(dequantize_g32(m.lm_head.weight, m.lm_head.d), table)
    ids = torch.tensor([[0, 5, 300], [7, 7, 1]])
    assert torch.equal(m.embed_tokens(ids), table[ids])
    h = torch.randn(5, table.shape[1])
    expect_logits = h.double() @ table.double().T
    assert (m.compute_logits(h) - expect_logits).abs().max() <= 2e-4 * expect_logits.abs().max()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fast = LLM(model=str(path), num_kv_blocks=64).generate(PROMPTS, params)
    monkeypatch.setattr(int8_gemv, "available", lambda: False)  # lm_head over the dequantized float table
    slow = LLM(model=str(path), num_kv_blocks=64).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
