"""DeepSeek V3 and Mistral 4: multi-head latent attention (mla.py) in every layer, a dense MLP in the first
``first_k_dense_replace`` layers and a mixture of experts with shared experts after them (grouped_moe.py).
DeepSeek V3 scores experts by a sigmoid plus ``e_score_correction_bias`` (the choice only) inside the
``topk_group`` best of ``n_group`` groups; Mistral 4 by a softmax. Mistral 4 also scales its queries with the
position past ``original_max_position_embeddings`` (``llama_4_scaling_beta``). The softmax scale is
``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared under a YaRN rope. The multi-token
prediction layers a DeepSeek V3 checkpoint may carry past ``num_hidden_layers`` are not loaded."""

from __future__ import annotations

import math
from typing import Any

from sidecar.model.args import ModelArgs, base_args, rope_settings
from sidecar.model.latent_args import GroupedRouting, LatentAttention


def _softmax_scale(cfg: dict[str, Any], qk_head_dim: int) -> float:
    """HF's attention scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` where the
    rope is scaled and names ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    _, scaling = rope_settings(cfg)
    if scaling and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    mistral = arch == "Mistral4ForCausalLM"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: {arch} hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    nope, rope_dim, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    params = cfg.get("rope_parameters") or {}
    beta = params.get("llama_4_scaling_beta") if mistral else None
    latent = LatentAttention(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        nope_dim=nope,
        rope_dim=rope_dim,
        v_dim=v_dim,
        interleave=bool(cfg.get("rope_interleave", True)),
        query_scale_beta=None if beta is None else float(beta),
        query_scale_from=int(params.get("original_max_position_embeddings") or 1),
    )
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if experts and (experts % n_group or not 0 < topk_group <= n_group):
        raise ValueError(
            f"model: {arch} n_group {n_group} must divide the {experts} experts and topk_group {topk_group} "
            "must be between 1 and n_group"
        )
    routing = GroupedRouting(
        scoring="softmax" if mistral else "sigmoid",
        correction_bias=not mistral,
        n_group=n_group,
        topk_group=topk_group,
        scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
    )
    first_dense = cfg.get("first_k_dense_replace") or 0
    return base_args(
        cfg,
        arch,
        head_dim=nope + rope_dim,
        rotary_dim=rope_dim,
        attn_scale=_softmax_scale(cfg, nope + rope_dim),
        num_experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok") or 0,
        expert_intermediate_size=cfg["moe_intermediate_size"],
        dense_layers=tuple(range(min(first_dense, cfg["num_hidden_layers"]))),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        latent=latent,
        routing=routing if experts else None,
    )
