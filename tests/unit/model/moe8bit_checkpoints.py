"""Tiny 8-bit mixture-of-experts checkpoints as the tools write them, and the HF transformers references they
are held to.

compressed-tensors quantizes ``Linear`` modules; transformers holds a sparse block's experts as stacked 3-D
tensors, so (as llm-compressor does for MoE models) the float checkpoint's tensors are first held as one
``nn.Linear`` a stored projection (``linear_tree``: the hub's per-expert names, ``experts.<e>.w1`` /
``experts.<e>.gate_proj``), then compressed-tensors' own ``apply_quantization_config``, ``calculate_qparams``
and ``ModelCompressor`` quantize and compress every Linear but ``lm_head`` and the routers, which the config
ignores as published MoE checkpoints do. The ``fp8`` method's layout is written from its documented tensor
names (e4m3 ``weight`` and ``weight_scale_inv`` per 128x128 block), as hf8bit_checkpoints.py does.

References: transformers loads the compressed directory itself where its loader takes the format's experts
(FP8 per channel; the ``fp8`` method with whole blocks); its expert converter knows packed and FP8 scales
only, and folds block scales by broadcasting, so for int8 (W8A8) experts and partial FP8 blocks it loads
the copy compressed-tensors' own decompressor writes (``decompressed_copy``). With ``activation_quant`` every
quantized projection's input goes through compressed-tensors' dynamic per-token quantize-dequantize (or
its static one at the stored ``input_scale``): on the Linear layers by forward pre-hooks, on the experts by
intercepting the products of transformers' own eager expert loop (``expert_products``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.hf8bit_checkpoints import STATIC_FACTORS, fp8_method_weights, set_weight_scale

# The sparse block's name in the hub's checkpoints and its experts' gate, up and down projections.
_QWEN3 = ("mlp", "gate_proj", "up_proj", "down_proj")
NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": _QWEN3, "qwen3_moe_step": _QWEN3}


def router_pattern(kind: str) -> str:
    return f"re:.*{NAMES[kind][0]}\\.gate$"


def linear_tree(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The checkpoint's tensors as modules named as stored: each 2-D ``<name>.weight`` but the embedding an
    ``nn.Linear``, everything else a parameter of a plain module."""
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for i, part in enumerate(path):
            if not hasattr(mod, part):
                linear = i == len(path) - 1 and leaf == "weight" and t.dim() == 2 and "embed" not in part
                mod.add_module(part, nn.Linear(t.shape[1], t.shape[0], bias=False) if linear else nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


def _save_tree(tree: nn.Module, out: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tree.state_dict().items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def ct_moe_checkpoint(
    kind: str,
    preset: str,
    fmt: str,
    out: Path,
    tokenizer_dir: Path,
    calibration: Optional[list[list[int]]] = None,
    router_scale: float = 1.0,
    **overrides,
) -> Path:
    """A compressed-tensors checkpoint of ``preset`` (W8A8, FP8_DYNAMIC, FP8_BLOCK) over every Linear of the
    ``kind`` family's tiny model (``overrides``: config fields) but lm_head and the routers; weight scales
    from ``calculate_qparams`` over each row or block. With ``calibration`` (W8A8) the activations are static
    per tensor, each projection's ``input_scale`` its absmax over the float model's run on those prompts
    (``STATIC_FACTORS`` for q/k/v, else 0.95: the largest activations clamp) divided by 127.5.
    ``router_scale`` multiplies the float routers' weights (top-k choices further from ties)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from safetensors.torch import load_file, save_file

    src = build_family_checkpoint(kind, out.with_name(out.name + "-float"), tokenizer_dir, **overrides)
    if router_scale != 1.0:
        tensors = load_file(str(src / "model.safetensors"))
        for name in [n for n in tensors if n.endswith(f".{NAMES[kind][0]}.gate.weight")]:
            tensors[name] = tensors[name] * router_scale
        save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    absmax = _calibrate(kind, src, calibration) if calibration else None
    shutil.copytree(src, out)
    tree = linear_tree(load_file(str(src / "model.safetensors")))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if absmax is not None:
        scheme.input_activations = scheme.input_activations.model_copy(
            update={"dynamic": False, "strategy": "tensor"}
        )
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", router_pattern(kind)])
    apply_quantization_config(tree, qc)
    for name, module in tree.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        set_weight_scale(module, scheme.weights)
        if absmax is not None:
            factor = STATIC_FACTORS.get(name.rsplit(".", 1)[-1], 0.95)
            module.input_scale.data.fill_(absmax[name] / 127.5 * factor)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format=fmt)
    compressor.compress_model(tree)
    _save_tree(tree, out)
    compressor.update_config(str(out))
    return out


def decompressed_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with every compressed projection decompressed by compressed-tensors from the tensors
    on disk (``ModelCompressor.decompress_model``), saved as a float checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    stored = load_file(str(model_dir / "model.safetensors"))
    float_dir = model_dir.with_name(model_dir.name + "-float")  # the layout's shapes (ct_moe_checkpoint)
    tree = linear_tree(load_file(str(float_dir / "model.safetensors")))
    config = QuantizationConfig.model_validate(qc)
    compressor = ModelCompressor(quantization_config=config)
    apply_quantization_config(tree, config)
    compressor.compress_model(tree)
    tree.load_state_dict(stored, strict=True)
    compressor.decompress_model(tree)
    shutil.copytree(model_dir, out)
    dense = {k: v for k, v in tree.state_dict().items() if not k.endswith(("_scale", "_zero_point"))}
    from safetensors.torch import save_file

    save_file({k: v.float().contiguous() for k, v in dense.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def fp8_method_moe_checkpoint(
    kind: str, out: Path, tokenizer_dir: Path, block: int = 128, **overrides
) -> Path:
    """A ``quant_method: fp8`` checkpoint of the ``kind`` family's tiny model: each decoder projection
    (experts included, the routers not) as e4m3 ``weight`` and float32 ``weight_scale_inv`` (absmax / 448 of
    each block), lm_head and the rest in float32."""
    out = build_family_checkpoint(kind, out, tokenizer_dir, **overrides)
    _, gate, up, down = NAMES[kind]
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", gate, up, down)
    ends = tuple(f".{p}.weight" for p in names)
    fp8_method_weights(out, lambda name: name.endswith(ends), block)
    return out


# A transform of an expert projection's input: (the checkpoint names of the parts of one product, e.g. an
# expert's gate and up, its input [rows, hidden]) -> the input each part takes.
Transform = Callable[[list[str], torch.Tensor], list[torch.Tensor]]


def expert_products(hf, kind: str, transform: Transform) -> None:
    """Route every expert product of ``hf`` (loaded with ``experts_implementation='eager'``) through
    ``transform``: during each experts module's forward, ``torch.nn.functional.linear`` on a view of its
    stacked ``gate_up_proj`` / ``down_proj`` takes the transformed input (one product per distinct input,
    the parts' outputs side by side); every other product is left as it is."""
    block, gate, up, down = NAMES[kind]
    for name, module in hf.named_modules():
        if not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
            continue
        layer = int(name.split(".")[2])  # model.layers.<i>.mlp.experts
        prefix = f"model.layers.{layer}.{block}.experts"
        module.forward = _intercepted(module, module.forward, prefix, (gate, up), (down,), transform)


def _intercepted(module, forward, prefix, gate_up, down, transform):
    def run(*args, **kwargs):
        plain = torch.nn.functional.linear

        def linear(x, w, b=None):
            for stack, parts in ((module.gate_up_proj, gate_up), (module.down_proj, down)):
                if w.untyped_storage().data_ptr() != stack.untyped_storage().data_ptr():
                    continue
                e = (w.storage_offset() - stack.storage_offset()) // stack.stride(0)
                xs = transform([f"{prefix}.{e}.{p}" for p in parts], x)
                if all(t is xs[0] for t in xs):
                    return plain(xs[0], w, b)
                rows = w.shape[0] // len(parts)
                return torch.cat([plain(t, w[j * rows : (j + 1) * rows]) for j, t in enumerate(xs)], dim=-1)
            return plain(x, w, b)

        torch.nn.functional.linear = linear
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = plain

    return run


def _quantized_linears(hf, kind: str):
    """(name, module) of the Linear layers the config quantizes: all but lm_head and the routers."""
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head" and not name.endswith(".gate"):
            yield name, module


def _calibrate(kind: str, float_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Each projection's input absmax over the float model's forward on ``prompts``, by checkpoint name; an
    expert no token picked takes the largest of its layer's experts for that projection."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(
        str(float_dir), dtype=torch.float32, experts_implementation="eager"
    )
    seen: dict[str, float] = {}

    def note(name: str, x: torch.Tensor) -> None:
        seen[name] = max(seen.get(name, 0.0), float(x.abs().max()))

    def transform(names, x):
        for n in names:
            note(n, x)
        return [x] * len(names)

    expert_products(hf, kind, transform)
    hooks = [
        m.register_forward_pre_hook(lambda mod, inp, n=n: note(n, inp[0]))
        for n, m in _quantized_linears(hf, kind)
    ]
    with torch.no_grad():
        for ids in prompts:
            hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    block, gate, up, down = NAMES[kind]
    cfg = hf.config
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.{block}.experts"
        for p in (gate, up, down):
            names = [f"{prefix}.{e}.{p}" for e in range(experts)]
            top = max((seen[n] for n in names if n in seen), default=None)
            for n in names if top is not None else ():
                seen.setdefault(n, top)
    return seen


def hf_moe_reference(
    model_dir: Path, kind: str, dense_dir: Optional[Path] = None, activation_quant: bool = False
):
    """HF transformers in float32 on ``model_dir`` (dequantized by its own loader) or on ``dense_dir`` (its
    decompressed copy), eager experts; with ``activation_quant`` each quantized projection's input quantized
    as compressed-tensors' forward quantizes it (per token, or at the stored static ``input_scale``)."""
    import transformers as tf
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    kwargs: dict = dict(dtype=torch.float32, experts_implementation="eager")
    if dense_dir is None and qc["quant_method"] == "compressed-tensors":
        kwargs["quantization_config"] = tf.CompressedTensorsConfig(dequantize=True)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(dense_dir or model_dir), **kwargs)
    hf.generation_config.eos_token_id = None
    if not activation_quant:
        return hf
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["input_activations"])
    static = {
        k[: -len(".input_scale")]: v.float()
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
        if k.endswith(".input_scale")
    }

    def quantize(name: str, x: torch.Tensor) -> torch.Tensor:
        if not args.dynamic:
            return fake_quantize(x, static[name], None, args)
        # [batch, tokens, features]: compressed-tensors keeps the first two axes (an expert's rows come 2-D)
        rows = x.unsqueeze(0) if x.dim() == 2 else x
        scale, zp = compute_dynamic_scales_and_zp(value=rows, args=args, module=None)
        return fake_quantize(rows, scale, zp, args).reshape(x.shape)

    def transform(names, x):
        if args.dynamic:  # one input, quantized once for the parts alike
            return [quantize(names[0], x)] * len(names)
        return [quantize(n, x) for n in names]

    expert_products(hf, kind, transform)
    for name, module in _quantized_linears(hf, kind):
        module.register_forward_pre_hook(lambda mod, inp, n=name: (quantize(n, inp[0]),))
    return hf
