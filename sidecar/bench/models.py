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
SHAPES = {"qwen2-0.5b": QWEN2_0_5B, "small": SMALL}


def bench_cache_dir() -> Path:
    from sidecar.model.demo import sidecar_home

    return sidecar_home() / "bench-models"


def random_checkpoint(shape: str = "qwen2-0.5b", seed: int = 0, out: Optional[Path] = None) -> Path:
    """Build (once) a random bfloat16 Qwen2 checkpoint of the named shape, with the demo tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sidecar.model.demo import ensure_demo_model

    if shape not in SHAPES:
        raise ValueError(f"model: unknown benchmark shape {shape!r} (known: {', '.join(SHAPES)})")
    out = Path(out) if out else bench_cache_dir() / f"{shape}-random-s{seed}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        **SHAPES[shape], eos_token_id=2, pad_token_id=0, bos_token_id=None, initializer_range=0.02
    )
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    demo = ensure_demo_model()
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    del model
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
