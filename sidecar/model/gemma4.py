"""Gemma 4 (text): the config mapping.

Layers of two kinds (``layer_types``): sliding-window layers and full ones, each kind with its own head size
and KV heads (``per_layer_config``: the full layers' ``head_dim`` / ``num_key_value_heads``) and its own rope
(``rope_parameters`` per kind; the full layers' "proportional" rope turns only the first
``partial_rotary_factor`` of each half of a head, the rest at frequency zero). Per layer: q, k and v heads are
RMS-normed (v without a weight), the attention scale is 1, the full layers of a checkpoint with
``attention_k_eq_v`` take their values from the key projection. The last ``num_kv_shared_layers`` layers
compute no keys or values: each reads those of the last earlier layer of its kind (``kv_source``), so they
keep no cache of their own. Per-layer input embeddings (``hidden_size_per_layer_input``) feed each layer a
gated residual; a MoE checkpoint (``enable_moe_block``) runs routed experts beside the dense MLP in every
layer. Norms scale by a plain ``w``. A ``Gemma4ForConditionalGeneration`` checkpoint (the published form)
serves its text model (``text_config``, tensors under ``model.language_model.``): prompts are text only. The
model itself: gemma4_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sidecar.model.args import ModelArgs, base_args
from sidecar.model.rope import RopeSpec

_KINDS = ("sliding_attention", "full_attention")


@dataclass
class Gemma4Args(ModelArgs):
    """``ModelArgs`` plus what only Gemma 4's layers read."""

    per_layer_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int = 0  # vocab_size_per_layer_input
    kv_from_k_layers: tuple[int, ...] = ()  # layers whose values are their key projection (attention_k_eq_v)
    wide_mlp_layers: tuple[int, ...] = ()  # layers whose MLP is twice intermediate_size (use_double_wide_mlp)
    rope_dims: tuple[int, ...] = ()  # the head size each rope kind turns (its layers' head_dim)
    # the module (sidecar.model.<name>) whose ``build(args)`` makes the decoder, in place of CausalLM
    decoder_module: ClassVar[str] = "gemma4_model"


def _layer_overrides(cfg: dict[str, Any], types: list[str]) -> dict[int, dict]:
    """Each layer's overrides of the config's fields. A config without ``per_layer_config`` (as the published
    ones are written) gives its full layers ``global_head_dim`` (512 when absent) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``, as transformers derives them."""
    if "per_layer_config" not in cfg:
        full = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        return {i: full for i, t in enumerate(types) if t == "full_attention"}
    raw = cfg.get("per_layer_config") or {}
    if isinstance(raw, list):
        return {i: dict(c or {}) for i, c in enumerate(raw)}
    return {int(k): dict(v or {}) for k, v in raw.items()}


def kv_sources(types: list[str], shared: int) -> tuple[int, ...]:
    """Each layer's cache owner: itself, or for one of the last ``shared`` layers the last earlier layer
    of its kind before them (transformers' ``kv_sharing_modes``)."""
    n = len(types)
    first = n - shared
    if shared and (shared >= n or set(types[first:]) - set(types[:first])):
        raise ValueError(
            f"model: Gemma4ForCausalLM num_kv_shared_layers {shared}: every shared layer's kind needs an "
            "earlier layer of that kind"
        )
    last = {t: i for i, t in enumerate(types[:first])}
    return tuple(i if i < first else last[types[i]] for i in range(n))


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    prefix = "model."
    if (
        "text_config" in cfg
    ):  # Gemma4ForConditionalGeneration: its text model; no vision or audio tower loaded
        text = cfg["text_config"]
        tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        cfg, prefix = dict(text, tie_word_embeddings=tied), "model.language_model."
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"model: {arch} activation {act!r} is not supported (gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention") == "all":  # "vision" leaves text tokens causal
        raise ValueError(f"model: {arch} use_bidirectional_attention 'all' is not supported (causal only)")
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [_KINDS[(i + 1) % 6 == 0] for i in range(n)])
    if len(types) != n or set(types) - set(_KINDS):
        raise ValueError(f"model: {arch} layer_types {types!r} must name each of the {n} layers")
    over = _layer_overrides(cfg, types)
    heads = cfg["num_attention_heads"]
    head_dims = tuple(over.get(i, {}).get("head_dim", cfg.get("head_dim") or 256) for i in range(n))
    kv_heads = tuple(
        over.get(i, {}).get("num_key_value_heads", cfg.get("num_key_value_heads") or heads) for i in range(n)
    )
    params = cfg.get("rope_parameters") or {}
    kinds = [t for t in _KINDS if t in types]
    specs, dims = [], []
    for t in kinds:
        p = params.get(t) or {"rope_type": "default", "rope_theta": 10000.0}
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ValueError(f"model: {arch} {t} rope_type {kind!r} is not supported (default, proportional)")
        specs.append(RopeSpec(float(p["rope_theta"]), None if kind == "default" else dict(p)))
        dims.append(head_dims[types.index(t)])
    for i, t in enumerate(types):
        if head_dims[i] != dims[kinds.index(t)]:
            raise ValueError(f"model: {arch} layers of kind {t} must share one head_dim")
    sources = kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0))
    moe = bool(cfg.get("enable_moe_block"))
    if moe and not cfg.get("num_experts"):
        raise ValueError(f"model: {arch} enable_moe_block needs num_experts")
    window = cfg.get("sliding_window")
    return Gemma4Args(
        **vars(
            base_args(
                cfg,
                arch,
                num_kv_heads=kv_heads[0],
                head_dim=head_dims[0],
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
                rope_kinds=tuple(specs),
                layer_rope=tuple(kinds.index(t) for t in types),
                qk_norm=True,
                sandwich_norms=True,
                hidden_act="gelu_tanh",
                embed_scale=cfg["hidden_size"] ** 0.5,
                attn_scale=1.0,
                final_softcap=cfg.get("final_logit_softcapping"),
                num_experts=int(cfg.get("num_experts") or 0) if moe else 0,
                experts_per_token=int(cfg.get("top_k_experts") or 0) if moe else 0,
                expert_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if moe else 0,
                layer_head_dims=head_dims,
                layer_kv_heads=kv_heads,
                kv_source=sources,
                checkpoint_prefix=prefix,
            )
        ),
        per_layer_dim=int(cfg.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
        kv_from_k_layers=tuple(
            i for i, t in enumerate(types) if cfg.get("attention_k_eq_v") and t == "full_attention"
        ),
        wide_mlp_layers=tuple(i for i in range(n) if cfg.get("use_double_wide_mlp") and sources[i] != i),
        rope_dims=tuple(dims),
    )


def lora_part_shapes(args: ModelArgs, layer: int) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the projections layer ``layer`` has (lora.py):
    its own head size and KV heads, a double-wide MLP where it has one; a layer reading another's KV has no
    k / v projections, one whose values are its keys no v."""
    h, hd, nkv = args.hidden_size, args.layer_head_dims[layer], args.layer_kv_heads[layer]
    inter = args.intermediate_size * (2 if layer in getattr(args, "wide_mlp_layers", ()) else 1)
    q = args.num_heads * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (q, h)}
    shapes.update(gate_proj=(h, inter), up_proj=(h, inter), down_proj=(inter, h))
    if args.kv_source[layer] != layer:
        del shapes["k_proj"], shapes["v_proj"]
    elif layer in getattr(args, "kv_from_k_layers", ()):
        del shapes["v_proj"]
    return shapes
