"""GGUF files of the Qwen3, Gemma 2, Gemma 3 and Phi-3 families, written with gguf.GGUFWriter the way llama.cpp's
converter writes them (its architecture and tensor names and metadata keys; Gemma's norms stored as 1 + w;
Phi-3's projections fused and its LongRoPE factors as tensors), load into our decoder and give greedy output
equal to HF transformers on the checkpoint they were written from; a Q4_0 file takes the exact int4 form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import FAMILIES, assert_not_degenerate, build_family_checkpoint

gguf = pytest.importorskip("gguf")  # a declared dependency; fails loudly below if absent
Q = gguf.GGMLQuantizationType
PROMPTS = [[5 + (7 * i + 3 * j) % 800 for j in range(n)] for i, n in enumerate([5, 12, 30, 16])]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
ARCH = {"qwen3": "qwen3", "qwen3_tied": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
}
GEMMA = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))


def _gguf_name(hf: str, gemma: bool) -> str:
    if hf.startswith("model.layers."):
        _, _, idx, rest = hf.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{idx}.{(GEMMA if gemma else LAYER)[mod]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        hf, "output.weight"
    )


def _add_tokenizer(w, tokenizer_dir: Path) -> int:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(2)
    return len(tokens)


def write_family_gguf(hf_dir: Path, path: Path, kind: str, linear_type=Q.F32) -> None:
    """``hf_dir``'s checkpoint as llama.cpp's converter writes it (decoder linears in ``linear_type``)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch, gemma = ARCH[kind], kind.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if kind == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if gemma:
        w.add_sliding_window(cfg["sliding_window"])
        if kind == "gemma3":  # its layers are not the default five-of-six pattern: say so, per layer
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                getattr(w, f"add_{key}")(cfg[key])
    if kind == "phi3":
        head = cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(0)
        for k in ("long", "short"):
            w.add_tensor(f"rope_factors_{k}.weight", np.array(rope[f"{k}_factor"], dtype=np.float32))
    _add_tokenizer(w, hf_dir)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1  # the converter stores Gemma's (1 + w)
        if a.ndim == 2 and name.startswith("model.layers.") and linear_type != Q.F32:
            w.add_tensor(_gguf_name(name, gemma), gguf.quants.quantize(a, linear_type), raw_dtype=linear_type)
        else:
            w.add_tensor(_gguf_name(name, gemma), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("gguf-families")
    # GGUF has no field for Gemma's query_pre_attn_scalar: llama.cpp takes the head size, so these do too.
    head = {"gemma2": 24, "gemma3": 32}
    return {
        k: build_family_checkpoint(
            k, root / k, demo_dir, **({"query_pre_attn_scalar": head[k]} if k in head else {})
        )
        for k in FAMILIES
    }


@pytest.mark.parametrize("kind", FAMILIES)
def test_float_file_matches_hf_on_the_checkpoint_it_came_from(family_dirs, tmp_path, kind):
    path = tmp_path / f"{kind}.gguf"
    write_family_gguf(family_dirs[kind], path, kind)
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_batched_tokens=16)
    assert (
        llm.engine.loaded.args.architecture
        == json.loads((family_dirs[kind] / "config.json").read_text())["architectures"][0]
    )
    outs = llm.generate(PROMPTS, GREEDY)
    ref = hf_greedy(family_dirs[kind], PROMPTS, GREEDY.max_tokens)
    assert_not_degenerate(ref)
    assert [o.token_ids for o in outs] == ref
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3"])
def test_q4_0_file_takes_the_exact_int4_form_and_runs(family_dirs, tmp_path, kind):
    path = tmp_path / f"{kind}-q4.gguf"
    write_family_gguf(family_dirs[kind], path, kind, Q.Q4_0)
    llm = LLM(model=str(path), num_kv_blocks=64)
    assert llm.engine.model_info["quantization"] == "int4"
    fp = LLM(model=str(path), dtype="float32", num_kv_blocks=64)  # the same codes dequantized
    a = [o.token_ids[0] for o in llm.generate(PROMPTS, GREEDY)]
    b = [o.token_ids[0] for o in fp.generate(PROMPTS, GREEDY)]
    assert sum(x == y for x, y in zip(a, b)) >= len(PROMPTS) // 2
    assert torch.is_tensor(llm.engine.loaded.model.rope_cos)
