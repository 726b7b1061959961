"""Tiny 8-bit checkpoints as the tools write them: compressed-tensors' own compressors
(``ModelCompressor``) for ``int-quantized`` W8A8 and ``float-quantized`` FP8 (per channel, 128x128 blocks),
and the ``fp8`` method's layout (e4m3 ``weight`` + ``weight_scale_inv`` per 128x128 block) written by hand
from its documented tensor names; and the HF transformers references they are held to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

SMALL = dict(
    hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2
)  # partial blocks
WHOLE = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4
)  # whole blocks


def float_model(kind: str, tokenizer_dir: Path, dims: dict, seed: int = 0):
    import transformers as tf

    common = dict(
        dims,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.3,  # peaked next-token distributions: greedy comparisons test numerics
        vocab_size=len(tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))),
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> Path:
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def _block_minmax(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    v = F.pad(w, (0, -k % bk, 0, -n % bn))
    v = v.view(v.shape[0] // bn, bn, v.shape[1] // bk, bk)
    return v.amin((1, 3)), v.amax((1, 3))


def ct_checkpoint(kind: str, preset: str, fmt: str, out: Path, tokenizer_dir: Path, dims: dict) -> Path:
    """A compressed-tensors checkpoint of ``preset`` (W8A8, FP8_DYNAMIC, FP8_BLOCK) over every Linear but
    lm_head, scales from compressed-tensors' ``calculate_qparams`` over each row (channel) or block."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = float_model(kind, tokenizer_dir, dims)
    qc = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, qc)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        set_weight_scale(module, scheme.weights)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return _copy_tokenizer(tokenizer_dir, out)


def set_weight_scale(module, args) -> None:
    """A quantized module's ``weight_scale`` from its weight's min / max as compressed-tensors' own
    ``calculate_qparams`` takes them (per row, or per block for the block strategy)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.data
    if args.strategy == "block":
        lo, hi = _block_minmax(w, *args.block_structure)
    else:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, _ = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)


def fp8_method_checkpoint(out: Path, tokenizer_dir: Path, dims: dict, block: int = 128) -> Path:
    """A ``quant_method: fp8`` checkpoint: each decoder projection as e4m3 ``weight`` and float32
    ``weight_scale_inv`` (absmax / 448 of each block), lm_head and the rest in float32."""
    model = float_model("llama", tokenizer_dir, dims)
    model.save_pretrained(out)
    fp8_method_weights(out, lambda name: name.endswith("_proj.weight"), block)
    return _copy_tokenizer(tokenizer_dir, out)


def fp8_method_weights(out: Path, chosen, block: int) -> None:
    """Rewrite the checkpoint in ``out`` as ``quant_method: fp8`` writes it: each weight whose name ``chosen``
    picks as e4m3 ``weight`` and float32 ``weight_scale_inv`` (absmax / 448 of each ``block`` x ``block``
    block), the config's ``quantization_config`` set."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if chosen(n)]:
        w = tensors[name]
        lo, hi = _block_minmax(w, block, block)
        s = torch.maximum(lo.abs(), hi.abs()) / 448.0
        full = s.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
        tensors[name] = (w / full).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale_inv")] = s.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(cfg))


def hf_model(model_dir: Path, activation_quant: bool = False):
    """HF transformers on ``model_dir`` in float32, weights dequantized by its own quantizer
    (compressed-tensors' decompression, or the fp8 method's dequantization on CPU). ``activation_quant``:
    each quantized Linear's input goes through compressed-tensors' own dynamic quantize-dequantize, as its
    quantized forward does."""
    import transformers as tf

    cfg = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    kwargs = {}
    if cfg["quant_method"] == "compressed-tensors":
        kwargs["quantization_config"] = tf.CompressedTensorsConfig(run_compressed=False)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs)
    if activation_quant:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

        args = QuantizationArgs(**cfg["config_groups"]["group_0"]["input_activations"])

        def hook(module, inputs):
            scale, zp = compute_dynamic_scales_and_zp(value=inputs[0], args=args, module=module)
            return (fake_quantize(inputs[0], scale, zp, args),)

        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.register_forward_pre_hook(hook)
    return hf


# static W8A8 input scales: each projection's calibrated absmax / 127.5 times this factor (q, k and v unequal,
# so a fused projection quantizes its input once per part; below 1, the largest activations clamp)
STATIC_FACTORS = {"q_proj": 0.9, "k_proj": 1.0, "v_proj": 1.1}


def ct_static_w8a8_checkpoint(
    kind: str, out: Path, tokenizer_dir: Path, calibration: list[list[int]]
) -> Path:
    """compressed-tensors ``int-quantized`` W8A8 with static per-tensor input scales (the W8A8 preset's
    weights, activations ``dynamic: false, strategy: tensor``): each Linear's ``input_scale`` from the float
    model's absmax over ``calibration`` (times ``STATIC_FACTORS``), weight scales from ``calculate_qparams``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = float_model(kind, tokenizer_dir, SMALL)
    absmax: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, inp, n=n: absmax.__setitem__(n, max(absmax.get(n, 0.0), float(inp[0].abs().max())))
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    with torch.no_grad():
        for ids in calibration:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    scheme.input_activations = scheme.input_activations.model_copy(
        update={"dynamic": False, "strategy": "tensor"}
    )
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        set_weight_scale(module, scheme.weights)
        factor = STATIC_FACTORS.get(name.rsplit(".", 1)[-1], 0.95)
        module.input_scale.data.fill_(absmax[name] / 127.5 * factor)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return _copy_tokenizer(tokenizer_dir, out)


def static_w8a8_reference(model_dir: Path):
    """HF transformers on ``model_dir`` (float32, weights dequantized by compressed-tensors) with each
    quantized Linear's input through compressed-tensors' own fake quantization at its stored
    ``input_scale``, as the tool's static forward does."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**cfg["config_groups"]["group_0"]["input_activations"])
    scales = {
        k[: -len(".input_scale")]: v.float()
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
        if k.endswith(".input_scale")
    }
    hf = hf_model(model_dir)
    for name, module in hf.named_modules():
        if name in scales:
            module.register_forward_pre_hook(
                lambda mod, inp, s=scales[name]: (fake_quantize(inp[0], s, None, args),)
            )
    assert scales, "no input_scale in the checkpoint"
    return hf
