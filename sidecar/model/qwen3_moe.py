"""Qwen3-MoE: Qwen3's attention (q/k norms, its own ``head_dim``) with sparse MLPs of width
``moe_intermediate_size``; layers listed in ``mlp_only_layers``, and those whose index + 1 is not a multiple
of ``decoder_sparse_step``, keep a dense MLP of width ``intermediate_size``. The router's top-k
probabilities are renormalised only with ``norm_topk_prob`` and cast to the model dtype before they weigh
the experts' outputs."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import ModelArgs, base_args


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    layers = cfg["num_hidden_layers"]
    dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step != 0)
    return base_args(
        cfg,
        arch,
        qk_norm=True,
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        expert_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        dense_layers=dense,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routing_weights_float32=False,
        moe_names=("mlp", "gate_proj", "up_proj", "down_proj"),
    )
