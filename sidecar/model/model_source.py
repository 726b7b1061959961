"""Where a model comes from and what it computes in: the device, the local checkpoint directory of a model
reference (a path, the demo model, or a hub id fetched with huggingface_hub), the compute dtype, the tokenizer
and the ids that end a generation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but CUDA is not available")
    return dev


def resolve_model_dir(model: str, revision: Optional[str] = None, demo_dir: Optional[str] = None) -> Path:
    """Return a local checkpoint directory for ``model``; raises ValueError naming the problem."""
    if model == "demo":
        from sidecar.model.demo import ensure_demo_model

        return ensure_demo_model(demo_dir)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} is a path but has no config.json")
        return path
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep + os.sep in model
    if looks_like_path:
        raise ValueError(f"model: local path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model,
            revision=revision,
            allow_patterns=[
                "*.json",
                "*.safetensors",
                "*.jinja",
                "tokenizer*",
                "*.model",
                "*.txt",
                "*.tiktoken",
            ],
        )
    except Exception as exc:  # network errors, unknown repo, offline mode
        raise ValueError(
            f"model: {model!r} is neither a local directory nor a reachable hub id "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return Path(local)


def _checkpoint_dtype(hf_config: dict) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def pick_dtype_with_reason(requested: str, hf_config: dict, device: torch.device) -> tuple[torch.dtype, str]:
    """The compute dtype and why: an explicit dtype is always obeyed; "auto" asks the hardware."""
    if requested != "auto":
        return _DTYPES[requested], f"requested {requested}"
    from sidecar.model.hardware import auto_dtype

    return auto_dtype(_checkpoint_dtype(hf_config), device, _linear_in_features(hf_config))


def _linear_in_features(hf_config: dict) -> tuple[int, ...]:
    """The input widths of a decoder's linear layers: the hidden size (q/k/v, gate/up, the head), the attention
    output's (o_proj) and the MLP's (down_proj)."""
    hf_config = hf_config.get("text_config") or hf_config  # a multimodal model's text model
    hidden = int(hf_config.get("hidden_size") or 0)
    heads = int(hf_config.get("num_attention_heads") or 0)
    head_dim = int(hf_config.get("head_dim") or (hidden // heads if heads else 0))
    widths = (hidden, heads * head_dim, int(hf_config.get("intermediate_size") or 0))
    return tuple(n for n in widths + (int(hf_config.get("moe_intermediate_size") or 0),) if n)


def pick_dtype(requested: str, hf_config: dict, device: torch.device) -> torch.dtype:
    return pick_dtype_with_reason(requested, hf_config, device)[0]


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer; ValueError naming ``model`` where it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ValueError(f"model: cannot load the tokenizer from {model_dir}: {exc}") from None


def eos_ids(model_dir: Path, hf_config: dict, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's, then the config's, then the tokenizer's."""
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(x for x in v if isinstance(x, int))

    gen = model_dir / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add((hf_config.get("text_config") or hf_config).get("eos_token_id", hf_config.get("eos_token_id")))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
