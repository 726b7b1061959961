"""DeepSeek V3 (llama.cpp's ``deepseek2``) from GGUF: what llama.cpp's converter writes, back in HF form.

The converter splits each layer's ``kv_b_proj`` [heads x (nope + v), kv_lora_rank] (per head: the key's
no-rope rows, then the value's) into ``attn_k_b`` [heads, kv_lora_rank, nope] (the key part transposed, for
llama.cpp's absorbed decode) and ``attn_v_b`` [heads, v, kv_lora_rank]; joined back exactly here, so the
engine's latent cache (mla.py) holds the same latent. ``kv_a_proj_with_mqa`` (the latent, then the rotary
key channels) and the queries are stored as HF holds them: llama.cpp rotates interleaved pairs, HF's
``rope_interleave``. Experts are stacked [experts, out, in] per projection; split back per expert.

The file records attention as one KV head of ``kv_lora_rank + rope`` channels (its MQA view); the model's
own sizes are ``key_length_mla`` / ``value_length_mla``. YaRN's softmax correction is written as
``rope.scaling.yarn_log_multiplier`` = 0.1 x ``mscale_all_dim``; llama.cpp's runtime scales the rope by
the same factor (HF's ``mscale`` equal to ``mscale_all_dim``). Where ``expert_weights_norm`` is absent the
top-k weights are not renormalised (llama.cpp's default). Experts scored by a softmax (llama.cpp's default
where ``expert_gating_func`` is absent) are DeepSeek V2's routing, not served: refused naming the key.
"""

from __future__ import annotations

import numpy as np
import torch

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_k_b": "self_attn.k_b",
    "attn_v_b": "self_attn.v_b",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_exps": "mlp.experts.gate",
    "ffn_up_exps": "mlp.experts.up",
    "ffn_down_exps": "mlp.experts.down",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def config_keys(reader, get, cfg: dict) -> None:
    """Latent attention sizes, YaRN, routing and the dense lead (module docstring); ValueError naming the key
    for what the engine cannot run."""
    names = {t.name for t in reader.tensors}
    experts = int(get("expert_count", 0) or 0)
    gating = get("expert_gating_func")
    if experts and gating != _SIGMOID:
        raise ValueError(
            f"model: GGUF key deepseek2.expert_gating_func {gating!r} is not supported "
            "(2, sigmoid: DeepSeek V3)"
        )
    if experts and not any(n.endswith(".exp_probs_b.bias") for n in names):
        raise ValueError("model: GGUF tensor exp_probs_b is missing (DeepSeek V3's routing correction bias)")
    latent_keys("deepseek2", get, cfg)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid")


def latent_keys(arch: str, get, cfg: dict) -> None:
    """What DeepSeek V3 and Mistral 4 files (``arch``) write alike: latent attention sizes, YaRN, the
    experts and the dense lead."""
    for key in ("attention.temperature_scale", "attention.temperature_length", "nextn_predict_layers"):
        if get(key):
            raise ValueError(f"model: GGUF key {arch}.{key} is not supported")
    experts = int(get("expert_count", 0) or 0)
    rope, key_len = int(get("rope.dimension_count")), int(get("attention.key_length_mla"))
    q_rank = get("attention.q_lora_rank")
    cfg.update(
        num_key_value_heads=cfg["num_attention_heads"],
        kv_lora_rank=int(get("attention.kv_lora_rank")),
        q_lora_rank=None if q_rank is None else int(q_rank),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_len - rope,
        v_head_dim=int(get("attention.value_length_mla")),
        head_dim=key_len,
        rope_interleave=True,
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        n_routed_experts=experts or None,
        num_experts_per_tok=int(get("expert_used_count", 0) or 0) or None,
        moe_intermediate_size=int(get("expert_feed_forward_length", cfg["intermediate_size"])),
        n_shared_experts=int(get("expert_shared_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=int(get("expert_group_count", 1)),
        topk_group=int(get("expert_group_used_count", 1)),
        hidden_act="silu",
    )
    params = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if get("rope.scaling.type") == "yarn":
        mul = get("rope.scaling.yarn_log_multiplier")
        if mul is None:
            raise ValueError(
                f"model: GGUF key {arch}.rope.scaling.yarn_log_multiplier is missing beside yarn"
            )
        mscale = float(np.float32(mul) / np.float32(0.1))  # as llama.cpp undoes the converter's factor
        params.update(
            rope_type="yarn",
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            mscale=mscale,
            mscale_all_dim=mscale,
        )
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = params


def fix_state(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """``state`` (GGUF tensors under HF names) as the HF checkpoint holds them; module docstring."""
    out = {}
    for name, t in state.items():
        if name.endswith(".e_score_correction.bias"):
            out[name.replace(".e_score_correction.bias", ".e_score_correction_bias")] = t
        elif name.endswith(".self_attn.k_b.weight"):
            p = name.removesuffix("k_b.weight")
            v_b = state[f"{p}v_b.weight"]  # [heads, v, rank]
            joined = torch.cat((t.transpose(1, 2), v_b), dim=1)  # [heads, nope + v, rank]
            out[f"{p}kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1]).contiguous()
        elif name.endswith(".mlp.experts.gate.weight"):
            p = name.removesuffix("gate.weight")
            for part, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                for e, w in enumerate(state[f"{p}{part}.weight"]):
                    out[f"{p}{e}.{hf}.weight"] = w.contiguous()
        elif not name.endswith(
            (".self_attn.v_b.weight", ".mlp.experts.up.weight", ".mlp.experts.down.weight")
        ):
            out[name] = t
    return out
