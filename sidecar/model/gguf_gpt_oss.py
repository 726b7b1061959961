"""gpt-oss (llama.cpp's ``gpt-oss``) from GGUF: what llama.cpp's converter writes, back in HF form.

The file holds each expert projection as its own tensor [experts, out, in] (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, with biases); HF holds gate and up interleaved along the output (gate in
the even columns of ``gate_up_proj`` [experts, in, 2 * width]) and every expert matrix as [in, out]. What the
file does not say is what llama.cpp's runtime assumes: sliding-window layers alternate with full ones,
sliding first; the clamped SwiGLU's limit is 7 and its alpha 1.702; YaRN's correction range is rounded
outward to whole dimensions (HF's ``truncate``).
"""

from __future__ import annotations

import torch

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."); experts are joined in fix_state.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate",
    "ffn_up_exps": "mlp.experts.up",
    "ffn_down_exps": "mlp.experts.down",
}


def config_keys(reader, get, cfg: dict) -> None:
    """Layer kinds, window, YaRN and the SwiGLU constants (module docstring)."""
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    cfg["sliding_window"] = int(get("attention.sliding_window", 128))
    cfg["intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
    params = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if get("rope.scaling.type") == "yarn":
        params.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            truncate=True,
        )
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = params
    cfg.update(attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, hidden_act="silu")


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them; module docstring."""
    out = {}
    for name, t in state.items():
        if name.endswith(".sinks.weight"):
            out[name.removesuffix(".weight")] = t
        elif ".mlp.experts." not in name:
            out[name] = t
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up = state[f"{p}.gate.{kind}"], state[f"{p}.up.{kind}"]
            joined = torch.stack(
                (gate, up), dim=-2 if kind == "weight" else -1
            )  # [E, out, 2, in] / [E, out, 2]
            if kind == "weight":
                out[f"{p}.gate_up_proj"] = joined.flatten(1, 2).transpose(1, 2).contiguous()
                out[f"{p}.down_proj"] = state[f"{p}.down.weight"].transpose(1, 2).contiguous()
            else:
                out[f"{p}.gate_up_proj_bias"] = joined.flatten(1, 2)
                out[f"{p}.down_proj_bias"] = state[f"{p}.down.bias"]
    return out
