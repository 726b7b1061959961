"""gpt-oss (llama.cpp's ``gpt-oss``) from GGUF: what llama.cpp's converter writes, back in HF form.

The file holds each expert projection as its own tensor [experts, out, in] (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, with biases); HF holds gate and up interleaved along the output (gate in
the even columns of ``gate_up_proj`` [experts, in, 2 * width]) and every expert matrix as [in, out]. What the
file does not say is what llama.cpp's runtime assumes: sliding-window layers alternate with full ones,
sliding first; the clamped SwiGLU's limit is 7 and its alpha 1.702; YaRN's correction range is rounded
outward to whole dimensions (HF's ``truncate``).

Published files hold the experts as MXFP4; their codes come back as the HF checkpoint's ``*_blocks`` and
``*_scales`` (gate and up interleaved by rows, as HF's ``gate_up_proj_blocks``), with ``quantization_config``
``mxfp4``, so the loader keeps them as codes where the MXFP4 kernel runs (mxfp4.py). A file whose experts
are only partly MXFP4 has them dequantized.
"""

from __future__ import annotations

import torch

from sidecar.model import mxfp4

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
    experts = [t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name]
    if experts and set(experts) == {"MXFP4"}:
        cfg["quantization_config"] = {"quant_method": "mxfp4"}


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names, MXFP4 experts as ``.blocks`` / ``.scales``) as the HF
    checkpoint holds them; module docstring."""
    state, out = dict(state), {}
    for name, t in state.items():
        if name.endswith(".sinks.weight"):
            out[name.removesuffix(".weight")] = t
        elif ".mlp.experts." not in name:
            out[name] = t
    codes = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        for part in ("gate", "up", "down"):
            if f"{p}.{part}.blocks" in state and not codes:
                blocks, scales = state.pop(f"{p}.{part}.blocks"), state.pop(f"{p}.{part}.scales")
                state[f"{p}.{part}.weight"] = mxfp4.dequantize(blocks, scales, torch.float32)
        if codes:  # [E, out, groups(, 16)] each; gate_up's rows interleave gate (even) and up (odd)
            for kind in ("blocks", "scales"):
                gate, up = state[f"{p}.gate.{kind}"], state[f"{p}.up.{kind}"]
                out[f"{p}.gate_up_proj_{kind}"] = torch.stack((gate, up), dim=2).flatten(1, 2).contiguous()
                out[f"{p}.down_proj_{kind}"] = state[f"{p}.down.{kind}"]
        for kind in ("bias",) if codes else ("weight", "bias"):
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
