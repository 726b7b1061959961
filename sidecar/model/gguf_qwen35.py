"""Qwen3.5 (llama.cpp's ``qwen35``; ``qwen35moe``: the same layers with Qwen3-MoE's expert tensors and a
shared expert) from GGUF: what llama.cpp's converter writes, back in HF form.

The converter's changes to the checkpoint, and their inverses here:
- norms scaled by ``(1 + w)`` (all but the DeltaNet's gated one) are stored as ``1 + w`` (computed in the
  checkpoint's float32): the config says ``norm_weights_include_one`` and the loader takes them as they are;
- ``A_log`` is stored as the decay rate ``-exp(A_log)`` (``ssm_a``): kept as that rate (``linear_attn.A``),
  which the DeltaNet uses directly;
- with fewer key than value heads, every value-head axis (the v rows of ``in_proj_qkv`` and of the conv
  taps, ``in_proj_z``, ``in_proj_a`` / ``in_proj_b``, ``dt_bias``, ``A_log``, the columns of ``out_proj``)
  is reordered from grouped by key head ``[k, v/k, d]`` to tiled ``[v/k, k, d]``: reordered back;
- the conv taps lose their singleton axis; multi-token-prediction layers (``nextn_predict_layers``) are
  appended after the decoder's: dropped (not served).
The full-attention layers' gated q_proj, like Qwen2's projections, is stored as HF holds it.
"""

from __future__ import annotations

import torch

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}


def config_keys(reader, get, cfg: dict) -> None:
    """The DeltaNet shape (llama.cpp's ``ssm.*`` keys), the layer kinds (``attention.recurrent_layers``),
    the rotated channels (``rope.dimension_count``) and the decoder's own layer count."""
    n = cfg["num_hidden_layers"] - int(get("nextn_predict_layers", 0) or 0)
    cfg["num_hidden_layers"] = n
    nk, nv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    cfg.update(
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // nv,
        linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
    )
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n]]
    rotary = int(get("rope.dimension_count", cfg["head_dim"]))
    cfg["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": cfg.pop("rope_theta"),
        "partial_rotary_factor": rotary / cfg["head_dim"],
    }
    cfg["norm_weights_include_one"] = True
    cfg["hidden_act"] = "silu"


def _regroup(t: torch.Tensor, dim: int, nk: int, nv: int, head: int) -> torch.Tensor:
    """Value heads along ``dim`` from the converter's tiled order [v/k, k, head] back to HF's grouped
    [k, v/k, head]."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], nv // nk, nk, head, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def fix_state(state: dict[str, torch.Tensor], cfg: dict, tiled: bool = True) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them; module docstring. ``tiled``:
    the converter reordered the value heads (Qwen3.5; Qwen3-Next's converter keeps HF's order)."""
    n = cfg["num_hidden_layers"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    out = {}
    for name, t in state.items():
        name = name.replace(".dt_bias.bias", ".dt_bias")  # ssm_dt.bias: HF's dt_bias
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n:
            continue  # a multi-token-prediction layer
        if ".linear_attn." in name and nk != nv and tiled:
            part = name.split(".linear_attn.")[1]
            if part in ("in_proj_qkv.weight", "conv1d.weight"):
                qk = 2 * nk * dk
                t = torch.cat((t[:qk], _regroup(t[qk:], 0, nk, nv, dv)))
            elif part == "in_proj_z.weight":
                t = _regroup(t, 0, nk, nv, dv)
            elif part in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A"):
                t = _regroup(t, 0, nk, nv, 1)
            elif part == "out_proj.weight":
                t = _regroup(t, 1, nk, nv, dv)
        if name.endswith(".linear_attn.conv1d.weight"):
            t = t.unsqueeze(1)
        out[name] = t
    return out
