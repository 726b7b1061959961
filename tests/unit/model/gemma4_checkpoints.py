"""Tiny random Gemma 4 text checkpoints written with transformers' own config and model classes, with what the
engine must reproduce switched on: sliding layers (window 6, shorter than the prompts) and full layers of
other head sizes and KV heads (``global_head_dim``, ``num_global_key_value_heads``), the full layers'
proportional rope and values from their key projection, per-layer input embeddings, the last layers sharing
earlier layers' KV (with double-wide MLPs), a final soft-cap; ``moe`` adds routed experts beside every layer's
MLP. Norm weights, layer scalars and router scales are drawn away from their identity so that each matters."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def gemma4_config(vocab: int, moe: bool = False, **overrides):
    import transformers as tf

    extra = (
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32) if moe else {}
    )
    fields = dict(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=6,
        layer_types=list(TYPES),
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=12.0,
        max_position_embeddings=256,
        initializer_range=0.3,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=not moe,
        **extra,
    )
    return tf.Gemma4TextConfig(**dict(fields, **overrides))


def build_gemma4_checkpoint(
    out: Path, tokenizer_dir: Path, moe: bool = False, seed: int = 0, **overrides
) -> Path:
    """A tiny random Gemma 4 checkpoint with the demo tokenizer, saved in HF format; ``overrides`` set config
    fields."""
    import transformers as tf

    cfg = gemma4_config(len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))), moe, **overrides)
    torch.manual_seed(seed)
    model = tf.Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)  # plain weights, 1 at init
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
        model.get_input_embeddings().weight.mul_(0.1)  # else a tied head echoes the last token
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def build_gemma4_vl_checkpoint(causal_dir: Path, out: Path) -> Path:
    """The published form (``Gemma4ForConditionalGeneration``, no vision or audio tower) holding the text
    model of the ``Gemma4ForCausalLM`` checkpoint at ``causal_dir``."""
    import transformers as tf

    causal = tf.Gemma4ForCausalLM.from_pretrained(str(causal_dir), dtype=torch.float32)
    cfg = tf.Gemma4Config(text_config=causal.config.to_dict(), vision_config=None, audio_config=None)
    model = tf.Gemma4ForConditionalGeneration(cfg)
    model.model.language_model.load_state_dict(causal.model.state_dict())
    model.lm_head.load_state_dict(causal.lm_head.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    for f in causal_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out
