"""Benchmark checkpoints built offline: random weights in the shape of real models.

Random weights make the speed and memory figures real (same shapes, same bytes
moved) without a model hub. They are cached under the user cache dir.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

# Qwen2.5-0.5B-Instruct's shapes.
QWEN2_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMALL = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Qwen3-30B-A3B's layer shapes (128 experts of width 768, 8 per token, hidden 2048) cut to 12 of its 48 layers,
# and to 2 where the 12 (15 GiB in bf16) do not fit the machine: a token's bytes per layer are the same.
QWEN3_30B_A3B_12L = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=12,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SHAPES = {
    "qwen2-0.5b": QWEN2_0_5B,
    "small": SMALL,
    "qwen3-30b-a3b-12l": QWEN3_30B_A3B_12L,
    "qwen3-30b-a3b-2l": dict(QWEN3_30B_A3B_12L, num_hidden_layers=2),
}


def bench_cache_dir() -> Path:
    from sidecar.model.demo import sidecar_home

    return sidecar_home() / "bench-models"


def random_checkpoint(shape: str = "qwen2-0.5b", seed: int = 0, out: Optional[Path] = None) -> Path:
    """Build (once) a random bfloat16 checkpoint of the named shape (Qwen2, or Qwen3-MoE for the shapes with
    experts), with the demo tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"model: unknown benchmark shape {shape!r} (known: {', '.join(SHAPES)})")
    out = Path(out) if out else bench_cache_dir() / f"{shape}-random-s{seed}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    if "num_experts" in SHAPES[shape]:
        _write_moe(SHAPES[shape], tmp)
        return _finish(tmp, out)
    cfg = Qwen2Config(
        **SHAPES[shape], eos_token_id=2, pad_token_id=0, bos_token_id=None, initializer_range=0.02
    )
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    return _finish(tmp, out)


def _finish(tmp: Path, out: Path) -> Path:
    """The demo tokenizer beside the weights, and the checkpoint moved into place."""
    from sidecar.model.demo import ensure_demo_model

    for f in ensure_demo_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _write_moe(shape: dict, out: Path) -> None:
    """A random bf16 Qwen3-MoE checkpoint in the hub's per-expert layout, written a layer per shard without
    building the model (the 12-layer cut holds 7.6B parameters)."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**shape, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.dtype = "bfloat16"
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    h, v, width = shape["hidden_size"], shape["vocab_size"], shape["moe_intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": ones(h)})
    shard("head.safetensors", {"lm_head.weight": rand(v, h)})
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {
            f"{p}.self_attn.q_proj.weight": rand(q, h),
            f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.self_attn.q_norm.weight": ones(shape["head_dim"]),
            f"{p}.self_attn.k_norm.weight": ones(shape["head_dim"]),
            f"{p}.input_layernorm.weight": ones(h),
            f"{p}.post_attention_layernorm.weight": ones(h),
            f"{p}.mlp.gate.weight": rand(shape["num_experts"], h),
        }
        for e in range(shape["num_experts"]):
            for name, size in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
                t[f"{p}.mlp.experts.{e}.{name}.weight"] = rand(*size)
        shard(f"layer-{i:03d}.safetensors", t)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
