"""Quantized models as a whole: which linears, in-place swap, save and reload.

A quantized checkpoint directory holds ``model.safetensors`` in our module naming
(``<linear>.qweight``, ``.scales``, ``.zeros`` for quantized linears, plain
tensors for everything else), ``quantization_config.json`` (the mode and format
recorded with the artifact), the HF ``config.json`` and the tokenizer files, so
``LLM(model=DIR)`` loads it without quantizing again.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from sidecar.config import head_mode, lm_head_quantization
from sidecar.model.quant import quantize_linear, quantize_tied_embedding, runtime_linear, tied_modules
from sidecar.model.quant_format import FORMAT_VERSION, check_quant_args, quantize_weight

PathLike = Union[str, os.PathLike]
CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
# Decoder linears (ours are fused; the HF names let the same code quantize HF models in benchmarks).
TARGET_NAMES = (
    "qkv_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    # Gemma 4's per-layer inputs: read by every token like the projections above (the per-layer embedding
    # table beside them is gathered a row per token and stays in the model dtype)
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
)
_HF_FILES = ("config.json", "generation_config.json")


def quant_targets(model: nn.Module, quantize_lm_head: bool) -> list[str]:
    """Names of the nn.Linear modules to quantize (``lm_head`` when ``quantize_lm_head``), in module order."""
    names = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and (
            leaf in TARGET_NAMES or (quantize_lm_head and leaf == "lm_head")
        ):
            names.append(name)
    return names


def tied_embedding_name(model: nn.Module, lm_head_name: str) -> Optional[str]:
    """Name of the nn.Embedding whose weight *is* lm_head's weight (tied), else None."""
    try:
        head = model.get_submodule(lm_head_name)
    except AttributeError:
        return None
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight is head.weight:
            return name
    return None


def head_quantization(mode: str, quantize_lm_head: Union[bool, str]) -> Optional[str]:
    """The output head's mode (None: kept in full precision) for layers quantized as ``mode`` and a
    ``quantize_lm_head`` setting (a HEAD_MODES name, or the older boolean: true is the layers' mode)."""
    return lm_head_quantization(mode, head_mode(quantize_lm_head))


def _module_mode(name: str, mode: str, head: Optional[str]) -> str:
    return head if head is not None and name.endswith("lm_head") else mode


def quantize_model(
    model: nn.Module, mode: str, group_size: int = 128, quantize_lm_head: Union[bool, str] = False
) -> None:
    """Swap a materialised model's linears for quantized modules, one at a time; the head (and a tied
    embedding) in ``head_quantization(mode, quantize_lm_head)``."""
    check_quant_args(mode, group_size)
    head = head_quantization(mode, quantize_lm_head)
    for name in quant_targets(model, head is not None):
        emb_name = tied_embedding_name(model, name) if name.endswith("lm_head") else None
        if emb_name is not None:
            emb, out = quantize_tied_embedding(model.get_submodule(emb_name), head, group_size)
            model.set_submodule(emb_name, emb)
            model.set_submodule(name, out)
        else:
            linear = model.get_submodule(name)
            model.set_submodule(
                name, quantize_linear(linear, _module_mode(name, mode, head), group_size, name)
            )


def part_quantizer(
    mode: Optional[str], group_size: int, quantize_lm_head: Union[bool, str]
) -> Optional[Callable[[nn.Module], None]]:
    """For a family that fills its own decoder (``load_checkpoint``): what quantizes each part as soon as it
    is filled (``quantize_model`` on a layer, then on the whole model for the head and what is left), so at
    most one layer is in full precision beside the quantized ones. None without a ``mode``."""
    if mode is None:
        return None
    return lambda part: quantize_model(part, mode, group_size, quantize_lm_head)


def save_quantized(
    model: nn.Module,
    tokenizer: Any,
    hf_config_dir: Optional[PathLike],
    out_dir: PathLike,
    mode: str,
    group_size: int = 128,
    quantize_lm_head: Union[bool, str] = False,
) -> dict[str, Any]:
    """Write a quantized checkpoint of a full-precision ``model``; returns the quantization config. The
    head (and a tied embedding) is stored in ``head_quantization(mode, quantize_lm_head)``, recorded as
    ``lm_head_mode`` (null: full precision).

    Quantizes one linear at a time into the stored format, so peak memory is the
    full-precision model plus the quantized copy being written.
    """
    from safetensors.torch import save_file

    hf_config_dir = None if hf_config_dir is None else os.fspath(hf_config_dir)
    out_dir = os.fspath(out_dir)
    check_quant_args(mode, group_size)
    if any(getattr(m, "packed", None) is not None for m in model.modules()):
        raise ValueError(
            "save_quantized: the model holds packed weights; load it with load_model(..., pack=False)"
        )
    head = head_quantization(mode, quantize_lm_head)
    targets = quant_targets(model, head is not None)
    dtype = next(model.parameters()).dtype
    state: dict[str, torch.Tensor] = {}
    consumed: set[int] = set()  # ids of parameters already written (tied tensors are written once)
    tied_embedding = None
    for name in targets:
        linear = model.get_submodule(name)
        emb_name = tied_embedding_name(model, name) if name.endswith("lm_head") else None
        prefix = emb_name or name
        tied_embedding = emb_name or tied_embedding
        stored_mode = _module_mode(name, mode, head)
        for key, t in quantize_weight(linear.weight.detach(), stored_mode, group_size, dtype, name).items():
            state[f"{prefix}.{key}"] = t.cpu().contiguous()
        consumed.add(id(linear.weight))
        if linear.bias is not None:
            state[f"{name}.bias"] = linear.bias.detach().cpu().contiguous()
            consumed.add(id(linear.bias))
    # A tensor reachable under several names (tied weights) is written once, under its first
    # name; the others are recorded as aliases so loading re-ties them.
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in first_name:
            aliases[key] = first_name[id(t)]
            continue
        first_name[id(t)] = key
        if id(t) not in consumed:
            state[key] = t.detach().cpu().contiguous()
    aliases = {k: v for k, v in aliases.items() if v in state}
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    qconfig = {
        "quant_method": "sidecar-weight-only",
        "format_version": FORMAT_VERSION,
        "mode": mode,
        "group_size": group_size if mode == "int4" else None,
        "quantize_lm_head": head is not None,
        "lm_head_mode": head,
        "tied_embedding": tied_embedding,
        "modules": targets,
        "aliases": aliases,
        "dtype": str(dtype).replace("torch.", ""),
    }
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as fh:
        json.dump(qconfig, fh, indent=2)
    for fname in _HF_FILES:
        src = os.path.join(hf_config_dir, fname) if hf_config_dir else None
        if (
            src
            and os.path.isfile(src)
            and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, fname))
        ):
            shutil.copyfile(src, os.path.join(out_dir, fname))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return qconfig


def read_quant_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, CONFIG_NAME)
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    if cfg.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version must be {FORMAT_VERSION}, got {cfg.get('format_version')!r}"
        )
    check_quant_args(cfg.get("mode"), cfg.get("group_size") or 128)
    return cfg


def load_quantized_model(
    model_dir: PathLike, model: nn.Module, dtype: torch.dtype, device: Any
) -> dict[str, Any]:
    """Materialise ``model`` (built on the meta device) from a quantized checkpoint, in place.

    Quantized linears become runtime modules built from their stored tensors one
    at a time; every other persistent parameter/buffer is loaded by name (cast to
    ``dtype`` when floating). Tied parameters stay tied. Raises ValueError naming a
    missing tensor. Non-persistent buffers (e.g. rotary tables) are left to the caller.
    """
    from safetensors import safe_open

    model_dir = os.fspath(model_dir)
    cfg = read_quant_config(model_dir)
    mode, device = cfg["mode"], torch.device(device)
    where: dict[str, str] = {}
    for f in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, f), framework="pt", device="cpu") as h:
            where.update((k, os.path.join(model_dir, f)) for k in h.keys())

    def get(key: str, cast: bool = True) -> torch.Tensor:
        if key not in where:
            raise ValueError(f"{model_dir}: checkpoint has no tensor {key!r}")
        # A handle per tensor: an open handle keeps every page read through it in our RSS.
        with safe_open(where[key], framework="pt", device="cpu") as h:
            t = h.get_tensor(key)
        if cast and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device)

    # Older checkpoints have no ``lm_head_mode``: a quantized head there is in the layers' mode.
    head = cfg.get("lm_head_mode") or (mode if cfg.get("quantize_lm_head") else None)

    def stored(prefix: str, m: str) -> dict[str, torch.Tensor]:
        keys = ("qweight", "scales") + (("zeros",) if m == "int4" else ())
        return {k: get(f"{prefix}.{k}", cast=k != "qweight") for k in keys}

    q8 = cfg.get("q8_0_tied_embedding")  # a GGUF Q8_0 token_embd shared with lm_head, kept as Q8_0
    if q8:
        from sidecar.model.q8_0 import tied_q8_0_modules

        emb, head = tied_q8_0_modules(
            get(f"{q8}.q8_weight"), get(f"{q8}.q8_scales", cast=False).float(), dtype
        )
        model.set_submodule(q8, emb)
        model.set_submodule("lm_head", head)
    tied = cfg.get("tied_embedding")
    for name in cfg["modules"]:
        meta_linear = model.get_submodule(name)
        m = _module_mode(name, mode, head)
        if tied and name.endswith("lm_head"):
            emb_dim = model.get_submodule(tied).embedding_dim
            emb, out = tied_modules(stored(tied, m), m, emb_dim, dtype)
            model.set_submodule(tied, emb)
            model.set_submodule(name, out)
            continue
        bias = get(f"{name}.bias") if meta_linear.bias is not None else None
        model.set_submodule(name, runtime_linear(stored(name, m), m, meta_linear.in_features, bias, dtype))
    # Remaining tensors. Names recorded as aliases (tied weights) get the very same tensor.
    aliases = cfg.get("aliases") or {}
    loaded: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not t.is_meta:
            continue
        src = aliases.get(key, key)
        if src not in loaded:
            value = get(src)
            loaded[src] = nn.Parameter(value, requires_grad=False) if isinstance(t, nn.Parameter) else value
        owner_name, _, attr = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attr in owner._parameters:
            owner._parameters[attr] = loaded[src]
        else:
            owner._buffers[attr] = loaded[src]
    return cfg
