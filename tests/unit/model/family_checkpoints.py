"""Tiny random checkpoints of the Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE families, written with
transformers' own config and model classes, with every feature the engine must reproduce switched on: head_dim
apart from hidden / heads, grouped KV heads, windows shorter than the prompts, tied and untied heads,
soft-caps small enough to bend the logits, per-layer-type rope bases, LongRoPE with an original length shorter
than some prompts (and crossed during generation by others), partial rotary, and norm weights away from their
identity so that every norm matters."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen3_tied", "gemma2", "gemma3", "phi3")
# Mixtures of experts: several experts per token, more experts than a decode batch has tokens (so some expert
# goes unpicked), and Qwen3-MoE's dense layers between sparse ones (``mlp_only_layers``, ``decoder_sparse_step``).
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen3_moe_step", "gpt_oss")
# Hybrid models: linear-attention (gated DeltaNet) layers among full-attention ones.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next")
# Families whose norms scale by (1 + w), but for Qwen3.5's gated DeltaNet norm (a plain w, initialised at 1).
_UNIT_OFFSET = ("gemma", "qwen3_5", "qwen3_next")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
    eos_token_id=2,
    pad_token_id=0,
    bos_token_id=None,
)


def _config(kind: str, vocab: int):
    import transformers as tf

    c = dict(_COMMON, vocab_size=vocab)
    if kind == "qwen3":
        return tf.Qwen3Config(
            **c,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
        ), tf.Qwen3ForCausalLM
    if kind == "qwen3_tied":
        return tf.Qwen3Config(
            **c,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=40,
            tie_word_embeddings=True,
            rope_theta=1e6,
        ), tf.Qwen3ForCausalLM
    if kind == "gemma2":
        return tf.Gemma2Config(
            **c,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            sliding_window=8,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
        ), tf.Gemma2ForCausalLM
    if kind == "gemma3":
        return tf.Gemma3TextConfig(
            **c,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
        ), tf.Gemma3ForCausalLM
    if kind == "phi3":
        return tf.Phi3Config(
            **c,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            original_max_position_embeddings=16,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.3, 1.9, 2.5],
                "long_factor": [3.0, 5.0, 9.0, 17.0],
            },
        ), tf.Phi3ForCausalLM
    if kind == "mixtral":
        return tf.MixtralConfig(
            **dict(c, intermediate_size=96),
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ), tf.MixtralForCausalLM
    if kind in ("qwen3_moe", "qwen3_moe_step"):
        step = kind == "qwen3_moe_step"
        return tf.Qwen3MoeConfig(
            **c,
            num_hidden_layers=3 if step else 4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_experts=6 if step else 8,
            num_experts_per_tok=2 if step else 3,
            moe_intermediate_size=64,
            norm_topk_prob=step,
            decoder_sparse_step=2 if step else 1,  # step: layer 1 sparse, 0 and 2 dense
            mlp_only_layers=[] if step else [0, 2],  # else: layers 1 and 3 sparse
            tie_word_embeddings=step,
        ), tf.Qwen3MoeForCausalLM
    if kind == "gpt_oss":
        # alternating sliding (window 6) and full layers, YaRN from an original length of 32 (crossed by
        # the prompts), a SwiGLU clamp low enough to bite; sinks, router and expert biases are set random
        return tf.GptOssConfig(
            **dict(c, intermediate_size=64),
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=2.0,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        ), tf.GptOssForCausalLM
    if kind == "qwen3_5":  # three gated DeltaNet layers, then one gated full-attention layer
        return tf.Qwen3_5TextConfig(
            **c,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            tie_word_embeddings=False,
        ), tf.Qwen3_5ForCausalLM
    if kind == "qwen3_5_vl":  # the published form: the text model above inside a vision-language one
        text, _ = _config("qwen3_5", vocab)
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
        return tf.Qwen3_5Config(
            text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False
        ), tf.Qwen3_5ForConditionalGeneration
    hybrid = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
    )
    # experts: three of eight per token (a one-row step leaves five unpicked), a gated shared expert
    experts = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
    if kind == "qwen3_5_moe":  # the dense model's layers above, every MLP sparse
        c.pop("intermediate_size")
        return tf.Qwen3_5MoeTextConfig(
            **c, **hybrid, **experts, num_hidden_layers=4, shared_expert_intermediate_size=48
        ), tf.Qwen3_5MoeForCausalLM
    if kind == "qwen3_5_moe_vl":
        text, _ = _config("qwen3_5_moe", vocab)
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
        return tf.Qwen3_5MoeConfig(
            text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False
        ), tf.Qwen3_5MoeForConditionalGeneration
    if kind == "qwen3_next":  # linear, full, linear, full; layer 0's MLP dense, the others sparse
        return tf.Qwen3NextConfig(
            **c,
            **hybrid,
            **experts,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        ), tf.Qwen3NextForCausalLM
    raise ValueError(kind)


def build_family_checkpoint(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` (one of FAMILIES) with the demo tokenizer, saved in HF format;
    ``overrides`` set config fields."""
    import transformers as tf

    cfg, cls = _config(kind, len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's and Qwen3.5's scale by (1 + w) and start at 0, the others at 1
                plain = not kind.startswith(_UNIT_OFFSET) or "linear_attn.norm" in name
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if plain else 0.0))
            elif kind == "gpt_oss" and name.endswith(
                ("sinks", "_bias", "router.bias")
            ):  # zeros or small at init
                p.copy_(torch.randn_like(p))
        if kind == "gemma2" and cfg.tie_word_embeddings:
            # The stream starts as the embedding times sqrt(hidden); through a tied head that term alone
            # gives the last token the top logit, so greedy output echoes it whatever the layers compute.
            # Smaller embeddings leave the layers to decide the next token.
            model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def assert_not_degenerate(outputs: list[list[int]]) -> None:
    """Greedy ``outputs`` of a checkpoint, one per prompt, vary (a model that echoes its last prompt token
    or loops on one token would let a comparison pass without exercising its layers)."""
    assert sum(len(set(o)) > 2 for o in outputs) > len(outputs) // 2, outputs
    assert len({t for o in outputs for t in o}) > 2 * len(outputs), outputs
