"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's blocks from a checkpoint that stores ``qkv_proj`` and
``gate_up_proj`` fused; LongRoPE ("su") scaling (rope.py); partial rotary where ``partial_rotary_factor`` < 1."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import ModelArgs, base_args


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    args = base_args(cfg, arch, sliding_window=cfg.get("sliding_window"), fused_checkpoint=True)
    scaling = args.rope_scaling
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("su", "longrope"):
        scaling = dict(scaling, rope_type="longrope")
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        args = base_args(
            cfg, arch, sliding_window=cfg.get("sliding_window"), fused_checkpoint=True, rope_scaling=scaling
        )
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    args.rotary_dim = int(args.head_dim * factor)
    return args
