"""Qwen3 (dense): Llama's blocks with an RMSNorm over each q and k head before rope; ``head_dim`` is the
config's own (not hidden / heads); a tied or untied head; windows per ``layer_types``."""

from __future__ import annotations

from typing import Any

from sidecar.model.args import ModelArgs, base_args, windows_from_layer_types


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    windows = windows_from_layer_types(cfg) if cfg.get("use_sliding_window") else None
    return base_args(cfg, arch, qk_norm=True, layer_windows=windows)
