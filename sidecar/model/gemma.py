"""Gemma 2 and Gemma 3 (text): the config mapping.

Both: embeddings scaled by sqrt(hidden), RMSNorms scaling by (1 + w), norms on the attention's and the MLP's
outputs as well as their inputs, a GeGLU MLP (tanh gelu), ``query_pre_attn_scalar ** -0.5`` as the attention
scale, sliding-window layers per ``layer_types``. Gemma 2 soft-caps the attention logits and the output
logits; Gemma 3 norms each q and k head and gives its sliding and its global layers their own rope base and
scaling (``rope_parameters`` per layer type; 4.x configs: ``rope_local_base_freq`` for the sliding layers).
"""

from __future__ import annotations

from typing import Any, Optional

from sidecar.model.args import ModelArgs, base_args, rope_settings, windows_from_layer_types
from sidecar.model.rope import RopeSpec

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(cfg: dict[str, Any], arch: str) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        return list(types)
    n = cfg["num_hidden_layers"]
    if arch == "Gemma2ForCausalLM":  # 4.x Gemma 2: even layers slide
        return [_LAYER_TYPES[i % 2] for i in range(n)]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return [_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n)]


def _rope_kinds(
    cfg: dict[str, Any], types: list[str]
) -> tuple[tuple[RopeSpec, ...], Optional[tuple[int, ...]]]:
    params = cfg.get("rope_parameters") or {}
    if all(t in params for t in set(types)):  # transformers 5: one entry per layer type
        specs = []
        for t in _LAYER_TYPES:
            p = params.get(t)
            if p is not None:
                kind = p.get("rope_type", p.get("type", "default"))
                specs.append((t, RopeSpec(float(p["rope_theta"]), None if kind == "default" else p)))
    else:
        theta, scaling = rope_settings(cfg)
        specs = [("full_attention", RopeSpec(theta, scaling))]
        if "rope_local_base_freq" in cfg:
            specs.append(("sliding_attention", RopeSpec(float(cfg["rope_local_base_freq"]))))
    names = [name for name, _ in specs]
    if len(specs) == 1:
        return (specs[0][1],), None
    return tuple(s for _, s in specs), tuple(names.index(t) for t in types)


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"model: {arch} activation {act!r} is not supported (gelu_pytorch_tanh)")
    types = _layer_types(cfg, arch)
    kinds, layer_rope = _rope_kinds(cfg, types)
    gemma3 = arch == "Gemma3ForCausalLM"
    return base_args(
        cfg,
        arch,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_windows=windows_from_layer_types(dict(cfg, layer_types=types)),
        rope_kinds=kinds,
        layer_rope=layer_rope,
        qk_norm=gemma3,
        sandwich_norms=True,
        # a checkpoint converted from GGUF holds 1 + w already (llama.cpp's converter adds it)
        norm_unit_offset=not cfg.get("norm_weights_include_one", False),
        hidden_act="gelu_tanh",
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
    )
