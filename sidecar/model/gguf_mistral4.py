"""Mistral 4 (llama.cpp's ``mistral4``) from GGUF: what llama.cpp's converter writes, back in HF form.

The converter writes Mistral 4 only from the published form, ``Mistral3ForConditionalGeneration`` whose
``text_config`` is a ``mistral4`` one without an ``architectures`` entry of its own (a
``Mistral4ForCausalLM`` directory is refused by the converter), and writes it as DeepSeek V3's layers
(gguf_deepseek.py): ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` and joined back exactly here, YaRN
with ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``. The experts are stored as HF holds them,
fused gate-and-up (``ffn_gate_up_exps``) and down (``ffn_down_exps``), beside the router and the shared
experts.

What the file does not say is what llama.cpp's runtime assumes: experts scored by a softmax (Mistral 4's;
``expert_gating_func`` sigmoid is refused by name), top-k weights renormalised only where
``expert_weights_norm`` is written, and the rope turning interleaved pairs (HF's ``rope_interleave``, its
default). The converter drops the queries' position scaling (``llama_4_scaling_beta``) and llama.cpp runs
such a file without it: so does the loader (a file that writes ``attention.temperature_scale`` is refused by
name, as this converter never writes it for ``mistral4``).
"""

from __future__ import annotations

import torch

from sidecar.model import gguf_deepseek

LAYER_NAMES = {
    **{k: v for k, v in gguf_deepseek.LAYER_NAMES.items() if not k.endswith("_exps") and k != "exp_probs_b"},
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def config_keys(reader, get, cfg: dict) -> None:
    """Latent attention, YaRN and the experts as for DeepSeek V3, scored by a softmax (module docstring);
    ValueError naming the key or tensor for what the engine cannot run."""
    gating = get("expert_gating_func")
    if gating not in (None, _SOFTMAX):
        raise ValueError(
            f"model: GGUF key mistral4.expert_gating_func {gating!r} is not supported (1, softmax: Mistral 4)"
        )
    bias = next((t.name for t in reader.tensors if t.name.endswith(".exp_probs_b.bias")), None)
    if bias is not None:
        raise ValueError(f"model: GGUF tensor {bias} is not supported (Mistral 4 has no routing bias)")
    gguf_deepseek.latent_keys("mistral4", get, cfg)
    cfg.update(architectures=["Mistral4ForCausalLM"], scoring_func="softmax")
    params = cfg["rope_parameters"]
    params["partial_rotary_factor"] = cfg["qk_rope_head_dim"] / cfg["head_dim"]


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them: ``kv_b_proj`` joined, the
    experts' tensors without the ``.weight`` the converter appends."""
    out = {}
    for name, t in gguf_deepseek.fix_state(state, cfg).items():
        if name.endswith((".mlp.experts.gate_up_proj.weight", ".mlp.experts.down_proj.weight")):
            name = name.removesuffix(".weight")
        out[name] = t
    return out
