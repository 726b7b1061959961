"""Llama 4 text (llama.cpp's ``llama4``) from GGUF: what llama.cpp's converter writes, back in HF form.

The converter keeps q / k rows as HF holds them (Llama 4's rope already rotates interleaved pairs, GGML's
own order), splits each sparse layer's fused ``experts.gate_up_proj`` [experts, hidden, 2 * width] into
``ffn_gate_exps`` / ``ffn_up_exps`` and stores every expert matrix outputs first; joined and transposed
back here. The dense MLP's width is ``feed_forward_length`` (HF's ``intermediate_size_mlp``), the experts'
and the shared expert's ``expert_feed_forward_length`` (HF's ``intermediate_size``).

What the file does not say is what llama.cpp's runtime assumes, taken here the same way: with no
``attention.sliding_window`` (the converter writes one only as 0, for models without chunking) layers
attend in chunks of 8192 tokens, every fourth layer (``attention.sliding_window_pattern`` where written)
attends to every key without rope, and the NoPE layers' query temperature has floor scale 8192 and scale
0.1; with ``attention.sliding_window`` 0 every layer is a full rope layer. q / k are L2-normalised after
rope unless the model has 128 experts (the 17B-128E shape, whose checkpoint has no q/k norm).
"""

from __future__ import annotations

import torch

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."); experts are joined in fix_state.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_exps": "feed_forward.experts.gate",
    "ffn_up_exps": "feed_forward.experts.up",
    "ffn_down_exps": "feed_forward.experts.down",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
}
_CHUNK, _FLOOR_SCALE, _ATTN_SCALE, _NOPE_STEP = 8192, 8192, 0.1, 4  # llama.cpp's runtime (module docstring)


def config_keys(reader, get, cfg: dict) -> None:
    """Widths, expert counts, chunking, NoPE layers and the q/k norm (module docstring); ValueError naming the
    key for what the engine cannot run."""
    n = cfg["num_hidden_layers"]
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        raise ValueError("model: GGUF key llama4.expert_count is missing or 0 (a Llama 4 file has experts)")
    rotary = int(get("rope.dimension_count", cfg["head_dim"]))
    if rotary != cfg["head_dim"]:
        raise ValueError(
            f"model: GGUF key llama4.rope.dimension_count {rotary} is not supported (the head size "
            f"{cfg['head_dim']}: Llama 4 rotates whole heads)"
        )
    if "rope_scaling" in cfg or any(t.name.startswith("rope_freqs") for t in reader.tensors):
        raise ValueError(
            "model: GGUF key llama4.rope.scaling.type / tensor rope_freqs: Llama 4 rope "
            "scaling is not supported"
        )
    window = get("attention.sliding_window")
    chunked = window is None or int(window) > 0
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # llama.cpp's key: a bool per layer, true for a chunked (and rope) layer
        use_rope = [int(bool(p)) for p in pattern]
    else:
        step = int(pattern) if pattern else _NOPE_STEP
        use_rope = [int((i + 1) % step != 0) for i in range(n)]
    if not chunked:
        use_rope = [1] * n
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    cfg.update(
        architectures=["Llama4ForCausalLM"],
        intermediate_size=int(get("expert_feed_forward_length")),
        intermediate_size_mlp=cfg["intermediate_size"],
        num_local_experts=experts,
        num_experts_per_tok=int(get("expert_used_count", 1)),
        interleave_moe_layer_step=int(get("interleave_moe_layer_step", 1)),
        moe_layers=sorted(sparse),
        no_rope_layers=use_rope,
        attention_chunk_size=int(window or _CHUNK) if chunked else None,
        layer_types=["chunked_attention" if r and chunked else "full_attention" for r in use_rope],
        use_qk_norm=experts != 128,
        attn_temperature_tuning=True,
        floor_scale=_FLOOR_SCALE,
        attn_scale=_ATTN_SCALE,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
        hidden_act="silu",
    )


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them; module docstring."""
    out = {k: v for k, v in state.items() if ".feed_forward.experts." not in k}
    for i in cfg["moe_layers"]:
        p = f"model.layers.{i}.feed_forward.experts"
        gate, up = state[f"{p}.gate.weight"], state[f"{p}.up.weight"]  # [experts, width, hidden]
        out[f"{p}.gate_up_proj"] = torch.cat((gate, up), dim=1).transpose(1, 2).contiguous()
        out[f"{p}.down_proj"] = state[f"{p}.down.weight"].transpose(1, 2).contiguous()
    return out
