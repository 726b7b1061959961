"""Qwen3-Next (llama.cpp's ``qwen3next``) from GGUF: what llama.cpp's converter writes, back in HF form.

Its layers are Qwen3.5-MoE's (gguf_qwen35.py) with the DeltaNet's input projections grouped by key head
(qwen3_next.py), and the converter's changes are Qwen3.5's but for these:
- ``in_proj_qkvz`` is split into ``attn_qkv`` (the q rows of every key head, then the k rows, then the v
  rows; the value heads in HF's order, never tiled) and ``attn_gate`` (the z rows): interleaved back into
  HF's groups ``[q, k, v, z]`` per key head, exactly;
- ``in_proj_ba`` is stored as HF holds it (``ssm_ba``), and so are the conv taps' channels (q, k, v, the
  order HF's forward brings them into);
- norms as ``1 + w``, ``A_log`` as ``-exp(A_log)``, ``dt_bias`` and the conv taps as for Qwen3.5.
The converter maps no dense MLP, so every layer the file holds is sparse; llama.cpp's runtime always
renormalises the top-k router weights (the loader's default where ``expert_weights_norm`` is not written).
"""

from __future__ import annotations

import torch

from sidecar.model import gguf_qwen35

LAYER_NAMES = {
    **gguf_qwen35.LAYER_NAMES,
    "ssm_ba": "linear_attn.in_proj_ba",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

config_keys = gguf_qwen35.config_keys  # the same ``ssm.*`` and layer keys


def _qkvz(qkv: torch.Tensor, z: torch.Tensor, cfg: dict) -> torch.Tensor:
    """HF's ``in_proj_qkvz`` from the converter's ``attn_qkv`` and ``attn_gate``: per key head its q and k
    rows, then the v and z rows of the value heads it serves."""
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    q, k, v = qkv.split([nk * dk, nk * dk, qkv.shape[0] - 2 * nk * dk])
    groups = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(groups, dim=1).reshape(-1, qkv.shape[-1])


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them; module docstring."""
    out = gguf_qwen35.fix_state(state, cfg, tiled=False)
    for name in [n for n in out if n.endswith(".linear_attn.in_proj_qkv.weight")]:
        base = name.removesuffix("qkv.weight")
        out[f"{base}qkvz.weight"] = _qkvz(out.pop(name), out.pop(f"{base}z.weight"), cfg)
    return out
