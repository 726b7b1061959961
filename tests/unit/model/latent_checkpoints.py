"""Tiny random DeepSeek V3 and Mistral 4 checkpoints, written with transformers' own config and model classes,
with what the engine must reproduce switched on: a latent rank below heads x head size, query heads wider
than value heads, a low-rank query (DeepSeek) and a full one (Mistral 4), interleaved and rotate-half rotary
channels, YaRN with its softmax-scale correction, Mistral 4's position-scaled queries from a length shorter
than the prompts, dense first layers, grouped routing with a correction bias (DeepSeek) and a softmax one
(Mistral 4), shared experts, and norm weights away from their identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

LATENT_FAMILIES = ("deepseek_v3", "mistral4")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    eos_token_id=2,
    pad_token_id=0,
    bos_token_id=None,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=16,  # below 4 heads x (16 + 8) key channels
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    tie_word_embeddings=False,
)


def _config(kind: str, vocab: int):
    import transformers as tf

    c = dict(_COMMON, vocab_size=vocab)
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(
            **c,
            q_lora_rank=24,
            v_head_dim=12,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,  # max_position_embeddings / original_max_position_embeddings
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ), tf.DeepseekV3ForCausalLM
    if kind == "mistral4":
        return tf.Mistral4Config(
            **dict(c, max_position_embeddings=1024),  # room for a prompt holding every token id
            q_lora_rank=None,
            v_head_dim=20,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=0,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 64.0,  # max_position_embeddings / original_max_position_embeddings
                "original_max_position_embeddings": 16,  # the queries' scale steps up at 16 and 32
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
                "partial_rotary_factor": 8 / 24,
            },
        ), tf.Mistral4ForCausalLM
    raise ValueError(kind)


def build_latent_checkpoint(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` (one of LATENT_FAMILIES) with the demo tokenizer, saved in HF
    format; ``overrides`` set config fields."""
    import transformers as tf

    cfg, cls = _config(kind, len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: a bias that moves the choice
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def build_mistral4_vl_checkpoint(causal_dir: Path, out: Path) -> Path:
    """The published form of Mistral 4 (``Mistral3ForConditionalGeneration`` with a one-layer vision tower,
    its ``text_config`` a ``mistral4`` one without an ``architectures`` entry, as published configs have
    it) holding the text model of the ``Mistral4ForCausalLM`` checkpoint at ``causal_dir``."""
    import transformers as tf

    causal = tf.Mistral4ForCausalLM.from_pretrained(str(causal_dir), dtype=torch.float32)
    text = causal.config.to_dict()
    text.pop("architectures", None)
    vision = dict(
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=32,
        patch_size=16,
    )
    cfg = tf.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = tf.Mistral3ForConditionalGeneration(cfg)
    model.model.language_model.load_state_dict(causal.model.state_dict())
    model.lm_head.load_state_dict(causal.lm_head.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    for f in causal_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out
