"""A PEFT LoRA adapter's ``adapter_config.json``: the modules it may target and the fields we serve."""

from __future__ import annotations

import json
import math
from pathlib import Path

# PEFT module name -> (fused projection, part index within it).
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# A fused checkpoint's module -> its parts in output-row order (the order our fused projections hold them).
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """A malformed or incompatible adapter; the message names the file and the field."""


def module_names(fused: bool) -> tuple[str, ...]:
    """The PEFT module names an adapter of a base with (``fused``) or without fused projections may target."""
    if not fused:
        return tuple(TARGETS)
    parts = {p for ps in FUSED_TARGETS.values() for p in ps}
    return tuple(FUSED_TARGETS) + tuple(t for t in TARGETS if t not in parts)


def read_config(path: Path, max_rank: int, fused: bool, arch: str) -> dict:
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise AdapterError(
            f"{cfg_file}: not found (a PEFT LoRA adapter directory has {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file}: must hold a JSON object")

    def bad(field: str, msg: str) -> AdapterError:
        return AdapterError(f"{cfg_file}: {field}: {msg}")

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad("peft_type", f"must be LORA, got {cfg.get('peft_type')!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_rank:
        raise bad("r", f"rank {r} is above max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    for field, ok in (
        ("use_dora", not cfg.get("use_dora")),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
        ("bias", cfg.get("bias", "none") in (None, "none")),
        ("modules_to_save", not cfg.get("modules_to_save")),
        ("rank_pattern", not cfg.get("rank_pattern")),
        ("alpha_pattern", not cfg.get("alpha_pattern")),
    ):
        if not ok:
            raise bad(field, f"{cfg.get(field)!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        known = module_names(fused)
        unknown = sorted(str(t).rsplit(".", 1)[-1] for t in targets if str(t).rsplit(".", 1)[-1] not in known)
        if unknown:
            raise bad(
                "target_modules",
                f"{', '.join(unknown)} not supported on {arch} (supported: {', '.join(known)})",
            )
    cfg["_scaling"] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return cfg
