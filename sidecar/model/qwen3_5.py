"""Qwen3.5 (dense, text): a hybrid of gated DeltaNet layers (deltanet.py; ``layer_types`` "linear_attention",
by default three of every four) and full-attention layers. The attention layers are Qwen3's (q/k norms,
``head_dim`` of its own) with partial rotary (``partial_rotary_factor``, a quarter by default) and a sigmoid
gate on their output; every RMSNorm of the checkpoint but the DeltaNet's gated one scales by ``(1 + w)``
(a GGUF file stores those as ``1 + w``: ``norm_weights_include_one``).
The text positions of its multimodal rope are one position per token, so the plain rope is HF's. A
``Qwen3_5ForConditionalGeneration`` checkpoint (the published ones) serves its text model: ``text_config``,
tensors under ``model.language_model.``; the vision tower is not loaded, so prompts are text only."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import LinearAttention, ModelArgs, base_args


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    prefix = "model."
    if "text_config" in cfg:  # Qwen3_5ForConditionalGeneration: the text model of a vision-language one
        text = cfg["text_config"]
        tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        cfg, prefix = dict(text, tie_word_embeddings=tied), "model.language_model."
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"model: {arch} layer_types {types!r} must name each of the {n} layers")
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: {arch} hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    linear = LinearAttention(
        num_k_heads=cfg["linear_num_key_heads"],
        num_v_heads=cfg["linear_num_value_heads"],
        k_dim=cfg["linear_key_head_dim"],
        v_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"model: {arch} linear_num_value_heads must be a multiple of linear_num_key_heads")
    return base_args(
        cfg,
        arch,
        qk_norm=True,
        norm_unit_offset=not cfg.get("norm_weights_include_one", False),  # GGUF: stored 1 + w
        rotary_dim=int(head_dim * factor),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear=linear,
        attn_output_gate=True,
        checkpoint_prefix=prefix,
    )
