"""Llama family (Llama 2/3, Qwen2, Mistral): the config mapping; the layers are the shared plain pre-norm blocks.

``LlamaForCausalLM`` is the shared decoder (decoder.py), the class every family's model is, kept under this
name for the code that builds one; ``ModelArgs`` and ``SUPPORTED_ARCHITECTURES`` are re-exported likewise.
"""

from __future__ import annotations

from typing import Any

from sidecar.model.args import SUPPORTED_ARCHITECTURES, ModelArgs, base_args
from sidecar.model.decoder import CausalLM

LlamaForCausalLM = CausalLM

__all__ = ["LlamaForCausalLM", "ModelArgs", "SUPPORTED_ARCHITECTURES", "args_from_config"]


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    window = None
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window")
    return base_args(
        cfg,
        arch,
        sliding_window=window,
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
    )
