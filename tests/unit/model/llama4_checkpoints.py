"""Tiny random Llama 4 checkpoints written with transformers' own config and model classes: chunks shorter than
the prompts, a NoPE layer among the rope layers with an attention temperature that varies over the prompts'
positions (``floor_scale`` of a few tokens), q/k L2 norms, dense layers between mixture-of-experts ones with
a shared expert, and the vision-language form whose text model the engine serves."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# llama4: chunk 16 (two blocks of 8), top-1 routing; llama4_k2: chunk 12 (not a whole number of blocks of
# 8: the reference path), top-2 routing, no q/k norms, every layer sparse; llama4_vl: llama4's text model
# inside Llama4ForConditionalGeneration.
KINDS = ("llama4", "llama4_k2", "llama4_vl")


def _text_config(kind: str, vocab: int, **overrides):
    import transformers as tf

    k2 = kind == "llama4_k2"
    fields = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=48,
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        num_local_experts=4,
        num_experts_per_tok=2 if k2 else 1,
        interleave_moe_layer_step=1 if k2 else 2,
        no_rope_layers=[1, 1, 0, 1],
        attention_chunk_size=12 if k2 else 16,
        use_qk_norm=not k2,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    return tf.Llama4TextConfig(**dict(fields, **overrides))


def build_llama4_checkpoint(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` (one of KINDS) with the demo tokenizer, saved in HF format;
    ``overrides`` set text config fields."""
    import transformers as tf

    vocab = len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    text = _text_config(kind, vocab, **overrides)
    if kind == "llama4_vl":
        vision = dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        )
        cfg, cls = (
            tf.Llama4Config(text_config=text.to_dict(), vision_config=vision),
            tf.Llama4ForConditionalGeneration,
        )
    else:
        cfg, cls = text, tf.Llama4ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from their identity, so that every norm matters
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out
