"""Gemma 4 text (llama.cpp's ``gemma4``) from GGUF: what llama.cpp's converter writes, back in HF form.

The file records each layer's kind (``attention.sliding_window_pattern``: true for a sliding layer), the
sliding and full layers' head sizes (``attention.key_length_swa`` / ``attention.key_length``), the KV heads
per layer (``attention.head_count_kv``, an array), the MLP width per layer (``feed_forward_length``: twice
the base width on the KV-sharing layers where the model has ``use_double_wide_mlp``), the last
``attention.shared_kv_layers`` layers reading earlier layers' caches, and the per-layer inputs' width
(``embedding_length_per_layer_input``). Full layers whose values are their key projection
(``attention_k_eq_v``) have no ``attn_v``. The full layers' proportional rope is stored as ``rope_freqs``
frequency factors, 1 for each rotated channel pair and 1e30 (never turning) for the rest: the rotated
fraction is read back from them. Weights are stored as HF holds them (Gemma 4's norms are plain weights);
``layer_output_scale`` is HF's ``layer_scalar``; the activation is GELU (tanh), as llama.cpp's runtime
assumes.

The mixture-of-experts block (``expert_count``; HF's ``enable_moe_block``) is stored as HF holds it, under
llama.cpp's names: the router's projection and its input scale (``ffn_gate_inp`` and its ``.scale``), the
experts' fused gate-and-up and down projections (``ffn_gate_up_exps``, ``ffn_down_exps``), and the router's
``per_expert_scale`` as the down projections' output scale (``ffn_down_exps.scale``: llama.cpp multiplies
each chosen expert's output by it, HF the expert's routing weight, the same product), read back as
``per_expert_scale``. (The converter folds that scale into the experts' own block scales only for NVFP4
experts, a type refused by name.) A file with split ``ffn_gate_exps`` / ``ffn_up_exps`` is joined back into
the fused form. HF runs the experts on every layer: a file whose routers are on some layers only is refused
naming the first layer without one.
"""

from __future__ import annotations

import torch

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
}
_UNTURNED = 1e30  # the converter's frequency factor for a channel pair the proportional rope leaves alone


def _per_layer(value, n: int, key: str) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
    if len(values) != n:
        raise ValueError(f"model: GGUF key gemma4.{key} has {len(values)} entries for {n} layers")
    return values


def config_keys(reader, get, cfg: dict) -> None:
    """Layer kinds, head sizes, KV sharing, per-layer inputs and rope (module docstring); ValueError naming
    the key for what the engine cannot run."""
    n = cfg["num_hidden_layers"]
    names = {t.name for t in reader.tensors}
    if get("expert_count"):
        _expert_keys(names, get, cfg)
    if get("attn_logit_softcapping"):
        raise ValueError("model: GGUF key gemma4.attn_logit_softcapping is not supported")
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ValueError(f"model: GGUF key gemma4.attention.sliding_window_pattern must list the {n} layers")
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    head, head_full = int(get("attention.key_length_swa")), int(get("attention.key_length"))
    for key, want in (("attention.value_length_swa", head), ("attention.value_length", head_full)):
        if int(get(key, want)) != want:
            raise ValueError(f"model: GGUF key gemma4.{key} must equal the key length {want}")
    if int(get("rope.dimension_count_swa", head)) != head:
        raise ValueError(
            f"model: GGUF key gemma4.rope.dimension_count_swa must be the sliding head size {head}"
        )
    kv = _per_layer(get("attention.head_count_kv"), n, "attention.head_count_kv")
    ff = _per_layer(get("feed_forward_length"), n, "feed_forward_length")
    shared = int(get("attention.shared_kv_layers", 0) or 0)
    wide = shared > 0 and ff[n - 1] == 2 * ff[0]
    if ff != [ff[0] * (2 if wide and i >= n - shared else 1) for i in range(n)]:
        raise ValueError(
            f"model: GGUF key gemma4.feed_forward_length {ff} is not supported (one width, "
            "twice that on the KV-sharing layers)"
        )
    names = {t.name for t in reader.tensors}
    full = [i for i, t in enumerate(types[: n - shared]) if t == "full_attention"]
    tensors = {t.name: t for t in reader.tensors}
    per_layer = int(get("embedding_length_per_layer_input", 0) or 0)
    cfg.update(
        architectures=["Gemma4ForCausalLM"],
        layer_types=types,
        head_dim=head,
        per_layer_config={
            i: {"head_dim": head if t == "sliding_attention" else head_full, "num_key_value_heads": kv[i]}
            for i, t in enumerate(types)
        },
        num_key_value_heads=kv[0],
        intermediate_size=ff[0],
        use_double_wide_mlp=wide,
        num_kv_shared_layers=shared,
        attention_k_eq_v=bool(full) and all(f"blk.{i}.attn_v.weight" not in names for i in full),
        hidden_size_per_layer_input=per_layer,
        sliding_window=int(get("attention.sliding_window")),
        final_logit_softcapping=get("final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh",
    )
    if per_layer:
        cfg["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[-1])
    params = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if "rope_freqs.weight" in tensors:
        factors = torch.from_numpy(tensors["rope_freqs.weight"].data.astype("float32"))
        turned = int((factors == 1.0).sum())
        unturned = torch.tensor(_UNTURNED, dtype=torch.float32)  # the value as the file holds it
        if (
            (factors[turned:] != unturned).any()
            or (factors[:turned] != 1).any()
            or 2 * len(factors) != head_full
        ):
            raise ValueError("model: GGUF tensor rope_freqs is not a proportional rope's (1s, then 1e30s)")
        params.update(rope_type="proportional", partial_rotary_factor=2 * turned / head_full)
    cfg["rope_parameters"] = {
        "full_attention": params,
        "sliding_attention": {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 1e4))},
    }


def _expert_keys(names: set[str], get, cfg: dict) -> None:
    """The experts' counts and width; ValueError naming the first layer without a router."""
    for i in range(cfg["num_hidden_layers"]):
        if f"blk.{i}.ffn_gate_inp.weight" not in names:
            raise ValueError(
                f"model: GGUF tensor blk.{i}.ffn_gate_inp.weight is missing: gemma4.expert_count is set and "
                "Gemma 4 runs its experts on every layer"
            )
    cfg.update(
        enable_moe_block=True,
        num_experts=int(get("expert_count")),
        top_k_experts=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
    )


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them: ``layer_scalar`` and the
    experts' tensors without the ``.weight`` the converter appends, split gate and up joined."""
    out = {}
    for name, t in state.items():
        if name.endswith(
            (".layer_scalar.weight", ".experts.gate_up_proj.weight", ".experts.down_proj.weight")
        ):
            name = name.removesuffix(".weight")
        out[name] = t
    for name in [n for n in out if n.endswith(".experts.gate_proj.weight")]:
        base = name.removesuffix(".gate_proj.weight")
        out[f"{base}.gate_up_proj"] = torch.cat((out.pop(name), out.pop(f"{base}.up_proj.weight")), dim=1)
    return out
