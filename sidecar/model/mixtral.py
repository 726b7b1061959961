"""Mixtral: Mistral's attention blocks with a sparse MLP in every layer -- a softmax router over
``num_local_experts`` SwiGLU experts, the top ``num_experts_per_tok`` probabilities renormalised to sum to
one (in float32, as the experts' outputs are weighed). The checkpoint names the block ``block_sparse_moe``
and an expert's gate, down and up projections ``w1``, ``w2``, ``w3``."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import ModelArgs, base_args


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    return base_args(
        cfg,
        arch,
        sliding_window=cfg.get("sliding_window"),
        num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 2),
        expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        routing_weights_float32=True,
        moe_names=("block_sparse_moe", "w1", "w3", "w2"),
    )
