"""Qwen3.5 (text), dense and MoE: a hybrid of gated DeltaNet layers (deltanet.py; ``layer_types``
"linear_attention", by default three of every four) and full-attention layers. The attention layers are
Qwen3's (q/k norms, ``head_dim`` of its own) with partial rotary (``partial_rotary_factor``, a quarter by
default) and a sigmoid gate on their output; every RMSNorm of the checkpoint but the DeltaNet's gated one
scales by ``(1 + w)`` (a GGUF file stores those as ``1 + w``: ``norm_weights_include_one``).
The text positions of its multimodal rope are one position per token, so the plain rope is HF's. A
``Qwen3_5ForConditionalGeneration`` checkpoint (the published ones) serves its text model: ``text_config``,
tensors under ``model.language_model.``; the vision tower is not loaded, so prompts are text only.

Qwen3.5-MoE (``Qwen3_5MoeForCausalLM`` / ``...ForConditionalGeneration``): every layer's MLP is sparse
(moe.py): a softmax router whose top ``num_experts_per_tok`` probabilities are always renormalised and cast
to the model dtype, experts of width ``moe_intermediate_size``, and a shared expert of width
``shared_expert_intermediate_size`` whose output is scaled by the sigmoid of ``shared_expert_gate``."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import LinearAttention, ModelArgs, base_args


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the text model's config, its tensors' prefix) of a checkpoint's config."""
    if "text_config" not in cfg:  # a ...ForConditionalGeneration: the text model of a vision-language one
        return cfg, "model."
    text = cfg["text_config"]
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return dict(text, tie_word_embeddings=tied), "model.language_model."


def _positive(cfg: dict[str, Any], arch: str, field: str) -> int:
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model: {arch} {field} must be a positive integer, got {value!r}")
    return value


def expert_args(cfg: dict[str, Any], arch: str, dense: tuple[int, ...], norm_topk: bool) -> dict[str, Any]:
    """ModelArgs fields of the Qwen3-Next / Qwen3.5-MoE sparse block: routed experts plus a gated shared
    expert; ``dense``: the layers with a plain MLP instead."""
    experts = _positive(cfg, arch, "num_experts")
    top_k = _positive(cfg, arch, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"model: {arch} num_experts_per_tok {top_k} exceeds num_experts {experts}")
    shared = cfg.get("shared_expert_intermediate_size", 0)
    if not isinstance(shared, int) or shared < 0:
        raise ValueError(f"model: {arch} shared_expert_intermediate_size must be >= 0, got {shared!r}")
    return dict(
        num_experts=experts,
        experts_per_token=top_k,
        expert_intermediate_size=_positive(cfg, arch, "moe_intermediate_size"),
        dense_layers=dense,
        norm_topk_prob=norm_topk,
        routing_weights_float32=False,
        shared_expert_size=shared,
        shared_expert_gate=True,
    )


def hybrid_args(cfg: dict[str, Any], arch: str, **extra: Any) -> ModelArgs:
    """The fields every gated-DeltaNet hybrid (Qwen3.5, Qwen3-Next) reads alike; ``extra`` adds the rest."""
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
        num_k_heads=_positive(cfg, arch, "linear_num_key_heads"),
        num_v_heads=_positive(cfg, arch, "linear_num_value_heads"),
        k_dim=_positive(cfg, arch, "linear_key_head_dim"),
        v_dim=_positive(cfg, arch, "linear_value_head_dim"),
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
        **extra,
    )


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    cfg, prefix = text_config(cfg)
    if not arch.startswith("Qwen3_5Moe"):
        return hybrid_args(cfg, arch, checkpoint_prefix=prefix)
    moe = expert_args(cfg, arch, dense=(), norm_topk=True)
    # no layer has a dense MLP: its width is the experts' (ModelArgs needs one)
    cfg = dict(cfg, intermediate_size=cfg.get("intermediate_size") or moe["expert_intermediate_size"])
    return hybrid_args(cfg, arch, checkpoint_prefix=prefix, **moe)
