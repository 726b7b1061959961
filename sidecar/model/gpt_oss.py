"""gpt-oss: grouped-query attention with biases and a learned sink logit per head, alternating sliding-window
and full layers (``layer_types``), YaRN rope; every layer a mixture of experts whose router has a bias and
softmaxes its top-k logits, and whose experts have biases and a clamped SwiGLU (``swiglu_limit``,
``swiglu_alpha``). Published checkpoints ship the experts' weights as MXFP4 (``mxfp4.py``): kept as codes on the
CPU, read by the MXFP4 kernel; dequantized exactly on load elsewhere."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import ModelArgs, base_args, rope_settings

# transformers' GptOssConfig defaults, for configs that leave them out
_THETA = 150000.0
_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = cfg.get("sliding_window", 128)
    params = cfg.get("rope_parameters") or {}
    theta, scaling = rope_settings(dict(cfg, rope_theta=cfg.get("rope_theta", _THETA)))
    if not params and not cfg.get("rope_scaling"):
        scaling = dict(_YARN)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("factor") is None:
        orig = scaling["original_max_position_embeddings"]
        scaling = dict(scaling, factor=cfg.get("max_position_embeddings", 131072) / orig)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model: {arch} activation {act!r} is not supported (silu)")
    return base_args(
        cfg,
        arch,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        attention_bias=bool(cfg.get("attention_bias", True)),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 4),
        expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=False,
        routing_weights_float32=False,
        moe_names=("mlp", "gate_up_proj", "gate_up_proj", "down_proj"),
        softmax_after_topk=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        attn_sinks=True,
    )
