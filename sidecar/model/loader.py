"""Resolve a model reference and load it into our decoder.

``"demo"`` builds/reuses the offline demo model; a GGUF file (or a directory
holding one), and the default model's name, are converted once into a cached
checkpoint directory (gguf.py) and read from there; an existing directory is read
as a Hugging Face checkpoint (config.json + *.safetensors, sharded or not); any
other string is treated as a hub id and fetched with huggingface_hub.

Weights are materialised one decoder layer at a time from memory-mapped
safetensors into a model built on the meta device, so peak memory stays near
the final model size (plus one layer) even when quantizing on load.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from sidecar.config import EngineConfig, lm_head_quantization
from sidecar.model.args import ModelArgs, checkpoint_view
from sidecar.model.decoder import CausalLM
from sidecar.model.deltanet import load_hybrid_mixer
from sidecar.model.file_rows import SafetensorsIndex
from sidecar.model.linear_layout import pack_weights
from sidecar.model import moe_cpu
from sidecar.model.moe import SparseMoE, stack_experts
from sidecar.model.model_source import (  # noqa: F401 (re-exported: callers import them from here)
    eos_ids,
    load_tokenizer,
    pick_dtype,
    pick_dtype_with_reason,
    resolve_device,
    resolve_model_dir,
)
from sidecar.model.pp_stage import Stage
from sidecar.model.tp_shard import Shard

log = logging.getLogger("sidecar.model")


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Any
    args: ModelArgs
    hf_config: dict
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    quantization: Optional[str]
    load_time_s: float
    dtype_reason: str = ""


def _set(
    module: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    if getattr(module, "preloaded", False):  # an HF quantized format's module, already filled (hf8bit.py)
        return
    old = getattr(module, name)
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(
            f"model: tensor for {type(module).__name__}.{name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(old.shape)}"
        )
    setattr(module, name, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))


def _load_linear(
    linear: nn.Linear, ckpt: SafetensorsIndex, names: Iterable[str], dtype: torch.dtype, device: torch.device
) -> None:
    # built already from a hub-quantized checkpoint's codes (hf_quant.py, hf8bit.py)
    if getattr(linear, "preloaded", False) or not isinstance(linear, nn.Linear) or not linear.weight.is_meta:
        return
    names = list(names)
    weights = [ckpt.get(f"{n}.weight") for n in names]
    _set(linear, "weight", torch.cat(weights, 0) if len(weights) > 1 else weights[0], dtype, device)
    if linear.bias is not None:
        biases = [ckpt.get(f"{n}.bias") for n in names]
        _set(linear, "bias", torch.cat(biases, 0) if len(biases) > 1 else biases[0], dtype, device)


def layer_norm_sources(args: ModelArgs, layer: int = 0) -> list[tuple[str, str]]:
    """(our module in a decoder layer, its HF name) for every norm of a layer. Our
    ``post_attention_layernorm`` is the norm in front of the MLP: HF Gemma's ``pre_feedforward_layernorm``,
    Gemma's ``post_attention_layernorm`` being the attention output's norm (our ``attn_out_norm``)."""
    names = [("input_layernorm", "input_layernorm")]
    if args.sandwich_norms:
        names += [
            ("attn_out_norm", "post_attention_layernorm"),
            ("post_attention_layernorm", "pre_feedforward_layernorm"),
            ("mlp_out_norm", "post_feedforward_layernorm"),
        ]
    else:
        names.append(("post_attention_layernorm", "post_attention_layernorm"))
    if args.qk_norm and not args.is_linear(layer):
        names += [("self_attn.q_norm", "self_attn.q_norm"), ("self_attn.k_norm", "self_attn.k_norm")]
    return names


def _norm_weight(args: ModelArgs, w: torch.Tensor) -> torch.Tensor:
    """A checkpoint norm weight as our RMSNorm's: ``1 + w`` (float32) where the family scales by it."""
    return w.float() + 1.0 if args.norm_unit_offset else w


def _maybe_quantize(parent: nn.Module, attr: str, cfg: EngineConfig, mode: Optional[str] = None) -> None:
    mode = mode or cfg.quantization
    if mode is None:
        return
    from sidecar.model.quant import quantize_linear

    setattr(parent, attr, quantize_linear(getattr(parent, attr), mode, cfg.quant_group_size))


def _load_weights(
    model: CausalLM,
    ckpt: SafetensorsIndex,
    cfg: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    head_mode: Optional[str],
    plain: bool = False,
) -> None:
    """The checkpoint's tensors into ``model``; ``head_mode``: the weight-only mode of a full-precision
    output head (and a tied embedding), None to keep it in ``dtype``; ``plain``: every weight as a plain
    tensor (MXFP4 experts dequantized), for callers that read or save them."""
    from tqdm.auto import tqdm

    args, top = model.args, model.args.checkpoint_prefix
    # a pipeline stage reads the tables it uses only: the embedding on the first, norm and head on the last
    first, last = getattr(model, "stage_ends", (True, True))
    # a hub-quantized checkpoint's quantized lm_head is in place already (no lm_head.weight: not tied)
    preloaded_head = not isinstance(model.lm_head, nn.Linear) or not model.lm_head.weight.is_meta
    tied = not preloaded_head and (args.tie_word_embeddings or "lm_head.weight" not in ckpt)
    # a table to quantize is read a block of rows at a time where it can be: never resident whole
    rows = getattr(ckpt, "rows", None) if device.type == "cpu" else None
    stream = tied and last and head_mode is not None and rows is not None
    if (first or (last and tied)) and not stream:
        _set(model.embed_tokens, "weight", ckpt.get(f"{top}embed_tokens.weight"), dtype, device)
    if tied and last and head_mode is not None:
        from sidecar.model.quant import quantize_tied_embedding

        # Quantized before the layers load so the full-precision table never coexists with them;
        # one quantized table (in the head's mode) serves both the embedding lookup and the tied lm_head.
        model.embed_tokens, model.lm_head = quantize_tied_embedding(
            model.embed_tokens,
            head_mode,
            cfg.quant_group_size,
            rows(f"{top}embed_tokens.weight", dtype, model.embed_tokens.weight) if stream else None,
        )
    for i, layer in enumerate(
        tqdm(
            model.layers,
            desc="loading layers",
            unit="layer",
            leave=False,
            disable=not log.isEnabledFor(logging.INFO),
        )
    ):
        if isinstance(layer, nn.Identity):  # another pipeline stage's layer (pp_stage.py)
            continue
        p = f"{top}layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        fused = args.fused_checkpoint  # Phi-3 stores the projections already fused
        gate_up = [f"{p}.mlp.gate_up_proj"] if fused else [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
        if getattr(attn, "latent", False):  # multi-head latent attention (mla.py)
            from sidecar.model.mla import load as load_latent

            load_latent(attn, ckpt.get, p, lambda m, n, t: _set(m, n, t, dtype, device))
        elif attn is None or attn.gate_proj is not None:  # hybrid layers (deltanet.py)
            load_hybrid_mixer(layer, ckpt, p, lambda m, n, t: _set(m, n, t, dtype, device))
        else:
            qkv = [f"{p}.self_attn.qkv_proj"] if fused else [f"{p}.self_attn.{x}_proj" for x in "qkv"]
            _load_linear(attn.qkv_proj, ckpt, qkv, dtype, device)
            _load_linear(attn.o_proj, ckpt, [f"{p}.self_attn.o_proj"], dtype, device)
            if attn.sinks is not None:
                _set(attn, "sinks", ckpt.get(f"{p}.self_attn.sinks"), dtype, device)
        if args.sparse(i):
            _load_experts(mlp, ckpt, p, args, cfg, dtype, device, plain)
        else:
            _load_linear(mlp.gate_up_proj, ckpt, gate_up, dtype, device)
            _load_linear(mlp.down_proj, ckpt, [f"{p}.mlp.down_proj"], dtype, device)
            for attr in ("gate_up_proj", "down_proj"):
                _maybe_quantize(mlp, attr, cfg)
        for ours, theirs in layer_norm_sources(args, i):
            module = layer.get_submodule(ours)
            _set(module, "weight", _norm_weight(args, ckpt.get(f"{p}.{theirs}.weight")), dtype, device)
        mixer = attn if attn is not None else layer.linear_attn  # a gated DeltaNet's b / a stay float
        mla = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # latent attention's (mla.py)
        for attr in ("qkv_proj", "o_proj", "gate_proj", "in_proj", "out_proj", *mla):
            if getattr(mixer, attr, None) is not None:
                _maybe_quantize(mixer, attr, cfg)
    if not last:
        return
    _set(model.norm, "weight", _norm_weight(args, ckpt.get(f"{top}norm.weight")), dtype, device)
    if not isinstance(model.lm_head, nn.Linear) or not model.lm_head.weight.is_meta:
        return  # a quantized lm_head of a hub-quantized checkpoint, or the quantized tied table's
    if tied:
        if isinstance(model.embed_tokens, nn.Embedding):  # not already quantized together above
            model.lm_head.weight = model.embed_tokens.weight
    elif head_mode is not None and rows is not None:
        from sidecar.model.quant import quantize_linear

        table = rows("lm_head.weight", dtype, model.lm_head.weight)
        model.lm_head = quantize_linear(model.lm_head, head_mode, cfg.quant_group_size, "lm_head", table)
    else:
        _set(model.lm_head, "weight", ckpt.get("lm_head.weight"), dtype, device)
        if head_mode is not None:
            _maybe_quantize(model, "lm_head", cfg, head_mode)


def _load_experts(
    moe: nn.Module,
    ckpt: SafetensorsIndex,
    layer_prefix: str,
    args: ModelArgs,
    cfg: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    plain: bool = False,
) -> None:
    """A sparse block's router (kept in full precision: a quantized router would move tokens between experts)
    and its experts, each quantized as it arrives where the engine quantizes; MXFP4 experts keep their codes
    where the MXFP4 kernel reads them (``mxfp4.keeps_codes``, its reason logged once where not) unless ``plain``."""
    from sidecar.model import mxfp4
    from sidecar.model.moe import block_tensors

    codes = args.expert_bias and not plain and not mxfp4.keeps_codes(device, cfg.quantization)
    tensors = getattr(moe, "block_tensors", None)  # a block with parts of its own (grouped_moe.py)
    parts_of = tensors(ckpt.get, ckpt.__contains__, layer_prefix) if tensors is not None else None
    for expert, parts in parts_of or block_tensors(moe, ckpt.get, ckpt.__contains__, layer_prefix, codes):
        for module, name, tensor in parts:
            _set(module, name, tensor, dtype, device)
        for attr in ("gate_up_proj", "down_proj") if expert is not None else ():
            if isinstance(getattr(expert, attr), mxfp4.Mxfp4Linear):  # codes arrive on the CPU, as stored
                getattr(expert, attr).to(device)
            _maybe_quantize(expert, attr, cfg)


def load_model(cfg: EngineConfig, pack: bool = True, shard: Union[Shard, Stage, None] = None) -> LoadedModel:
    """Load config, tokenizer and weights for ``cfg.model``. Raises ValueError naming the problem.

    On CPU the full-precision linear layers are then packed for oneDNN (``linear_layout.pack_weights``);
    ``pack=False`` keeps plain weights (MXFP4 experts dequantized), for callers that read or save them. With
    ``shard`` the model holds one tensor-parallel rank's slices (tp_shard.py), or one pipeline stage's layers
    (pp_stage.py); ``args`` stay the whole model's."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    from sidecar.model.gguf import find_gguf, model_dir_for

    gguf_file = None if cfg.model == "demo" else find_gguf(cfg.model)
    model_dir = (
        model_dir_for(gguf_file, cfg.quantization, cfg.dtype)
        if gguf_file is not None
        else resolve_model_dir(cfg.model, cfg.revision, cfg.demo_dir)
    )
    hf_config = json.loads((model_dir / "config.json").read_text())
    args = ModelArgs.from_hf_config(hf_config)
    dtype, dtype_reason = pick_dtype_with_reason(cfg.dtype, hf_config, device)
    tokenizer = load_tokenizer(model_dir)
    quant_file = model_dir / "quantization_config.json"
    with torch.device("meta"):
        local = args if shard is None else shard.local_args(args)
        own = getattr(local, "decoder_module", None)  # a family with a decoder of its own (gemma4.py)
        model = CausalLM(local) if own is None else import_module(f"sidecar.model.{own}").build(local)
    split = "pipeline_parallel_size" if isinstance(shard, Stage) else "tensor_parallel_size"
    if isinstance(shard, Stage):
        shard.prune(model)
    if quant_file.exists() and shard is not None:
        raise ValueError(f"{split}: {model_dir} is a quantized checkpoint; split its source")
    if quant_file.exists():
        from sidecar.model.quant_checkpoint import load_quantized_model

        if cfg.quantization is not None:
            saved = json.loads(quant_file.read_text()).get("mode")
            if saved != cfg.quantization:
                raise ValueError(
                    f"quantization: checkpoint {model_dir} is already quantized as {saved!r}, "
                    f"cannot load it as {cfg.quantization!r}"
                )
        load_quantized_model(model_dir, model, dtype, device)
        quantization = json.loads(quant_file.read_text()).get("mode")
    else:
        ckpt, quantization = checkpoint_view(args, SafetensorsIndex(model_dir)), cfg.quantization
        head = lm_head_quantization(cfg.quantization, cfg.quantize_lm_head)
        own = getattr(model, "load_checkpoint", None)  # a decoder that fills itself (gemma4_model.py)
        if "quantization_config" in hf_config:  # quantized by its producing tool (GPTQ, AWQ, ...)
            from sidecar.model.hf_quant import head_quantization, load_hf_quantized

            if own is not None:
                raise ValueError(f"quantization_config: {args.architecture} is read in our formats only")
            mxfp4 = (hf_config["quantization_config"] or {}).get("quant_method") == "mxfp4"
            if shard is not None and not (mxfp4 and isinstance(shard, Shard)):  # experts' codes: tp_shard.py
                raise ValueError(f"{split}: checkpoints with a quantization_config are not split")
            quantization = load_hf_quantized(model, ckpt, hf_config, cfg.quantization, dtype, device)
            if cfg.quantization is None and quantization is not None:  # the tool's format, not ours
                head = head_quantization(quantization, cfg.quantize_lm_head, model.lm_head)
        if own is not None:
            from sidecar.model.quant_checkpoint import part_quantizer

            quantize = part_quantizer(quantization, cfg.quant_group_size, cfg.quantize_lm_head)
            own(ckpt.get, lambda m, n, t: _set(m, n, t, dtype, device), quantize)
        else:
            view = ckpt if shard is None else shard.checkpoint(ckpt, args)
            _load_weights(model, view, cfg, dtype, device, head, not pack)
    if isinstance(shard, Stage):
        shard.wrap(model, args)  # the tables it did not load go before anything walks the weights
    max_len = args.max_position_embeddings
    if cfg.max_model_len is not None:
        if cfg.max_model_len > max_len:
            raise ValueError(
                f"max_model_len: {cfg.max_model_len} exceeds the model's max_position_embeddings {max_len}"
            )
        max_len = cfg.max_model_len
    if args.attn_sinks:
        log.info(
            "attention sinks: prompt rows attend on the torch path (the prefill kernels do not take sinks)"
        )
    if args.interleaved_rope:
        log.info(
            "interleaved rope: rope, q/k L2 norms and the KV write run on the torch path (the fused rope + "
            "KV-write kernels rotate halves); attention takes the kernels"
        )
    if args.latent is not None:
        from sidecar.model.mla import FAST_PATH_REASON

        log.info("multi-head latent attention: %s", FAST_PATH_REASON)
    model.init_rope(max_len, device, dtype)
    stack_experts(model, device)  # the ``moe`` fast path's stacked expert weights, where it can run
    model.share_fast_paths()
    model.eval()
    if pack and device.type == "cpu":
        pack_weights(model, consume=True)  # the weights were just read: nothing else holds them
    if device.type == "cpu":  # the grouped expert path against the per-expert loop, where it runs
        moe_cpu.self_check([m for m in model.modules() if isinstance(m, SparseMoE)], dtype)
    if shard is not None and not isinstance(shard, Stage):
        shard.wrap(model, args)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        args=args,
        hf_config=hf_config,
        model_dir=model_dir,
        dtype=dtype,
        device=device,
        max_model_len=max_len,
        eos_token_ids=eos_ids(model_dir, hf_config, tokenizer),
        quantization=quantization,
        load_time_s=time.perf_counter() - t0,
        dtype_reason=dtype_reason,
    )
