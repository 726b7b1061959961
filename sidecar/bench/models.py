"""Benchmark checkpoints built offline: random weights in the shape of real models.

Random weights make the speed and memory figures real (same shapes, same bytes
moved) without a model hub. They are cached under the user cache dir. Each shape
names its family (the transformers config and model classes that build it) and
the config's fields; the checkpoint gets the demo tokenizer with its vocabulary
filled up to the model's ``vocab_size`` (see ``write_tokenizer``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

# family -> (config class, model class) of transformers
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),  # written tensor by tensor (``_write_moe``)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),  # likewise, experts in MXFP4 (``_write_gpt_oss``)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
}

# Qwen2.5-0.5B-Instruct's shapes.
QWEN2_0_5B = dict(
    family="qwen2",
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
# Qwen3-0.6B's shapes: head_dim 128 apart from hidden / heads (2048 wide q against a 1024 wide stream), per-head
# q/k RMSNorms (every Qwen3), a tied head.
QWEN3_0_6B = dict(
    family="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Gemma-3-1B's shapes: one kv head of 256, 512-token windows on five layers of every six (the sixth global), rope
# base 10,000 on the sliding layers and 1e6 on the global ones, a 262,144-token tied head.
GEMMA3_1B = dict(
    family="gemma3",
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    sliding_window=512,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMALL = dict(
    family="qwen2",
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
    family="qwen3_moe",
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
# gpt-oss-20b's shapes (32 experts of width 2880, 4 per token, hidden 2880, sinks, alternating 128-token windows),
# its experts in MXFP4 as the published checkpoint ships them; cut to 2 of its 24 layers.
GPT_OSS_20B = dict(
    family="gpt_oss",
    hidden_size=2880,
    intermediate_size=2880,
    num_local_experts=32,
    num_experts_per_tok=4,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    vocab_size=201088,
    max_position_embeddings=131072,
    rope_theta=150000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# A Qwen3.5-0.8B-class text model: 18 gated DeltaNet layers (16 key and 16 value heads of 128, a 4-tap convolution) and
# 6 gated full-attention layers (8 query heads and 2 KV heads of 256, a quarter of each rotary), every fourth
# layer; a tied 248,320-token head.
QWEN3_5_0_8B = dict(
    family="qwen3_5",
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    vocab_size=248320,
    max_position_embeddings=262144,
    rope_theta=10000000.0,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SHAPES = {
    "qwen2-0.5b": QWEN2_0_5B,
    "qwen3-0.6b": QWEN3_0_6B,
    "gemma3-1b": GEMMA3_1B,
    "small": SMALL,
    "qwen3-30b-a3b-12l": QWEN3_30B_A3B_12L,
    "qwen3-30b-a3b-2l": dict(QWEN3_30B_A3B_12L, num_hidden_layers=2),
    "gpt-oss-20b-2l": dict(GPT_OSS_20B, num_hidden_layers=2),
    "qwen3.5-0.8b": QWEN3_5_0_8B,
}


def bench_cache_dir() -> Path:
    from sidecar.model.demo import sidecar_home

    return sidecar_home() / "bench-models"


def build_config(shape: dict[str, Any], initializer_range: float = 0.02):
    """The transformers config of ``shape`` (a ``SHAPES`` entry or one like it: ``family`` and the config's
    fields), with the demo tokenizer's special ids. Gemma 3's ``rope_local_base_freq`` and
    ``sliding_window_pattern`` become the per-layer-type ``rope_parameters`` and ``layer_types`` of its config;
    Qwen's ``rope_theta`` (and Qwen3.5's ``partial_rotary_factor``) its ``rope_parameters``."""
    import transformers

    fields = dict(shape)
    family = fields.pop("family")
    if family not in FAMILIES:
        raise ValueError(f"model: unknown benchmark family {family!r} (known: {', '.join(FAMILIES)})")
    theta = float(fields.pop("rope_theta"))
    if family == "gemma3":
        local = float(fields.pop("rope_local_base_freq"))
        pattern = int(fields.pop("sliding_window_pattern"))
        n = fields["num_hidden_layers"]
        fields["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
        fields["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
            "full_attention": {"rope_type": "default", "rope_theta": theta},
        }
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        if "partial_rotary_factor" in fields:  # Qwen3.5: the rotary share is a rope parameter
            fields["rope_parameters"]["partial_rotary_factor"] = fields.pop("partial_rotary_factor")
    cls = getattr(transformers, FAMILIES[family][0])
    return cls(
        **fields, eos_token_id=2, pad_token_id=0, bos_token_id=None, initializer_range=initializer_range
    )


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """The demo tokenizer in ``out``, its vocabulary filled with unreachable ``<fill_N>`` entries so that its ids
    are exactly 0..vocab_size-1: the same text gives the same ids, and every id the model has is a token.
    llama.cpp's Gemma 3 conversion cuts the embedding down to the tokenizer's size, so a smaller tokenizer would
    hand llama.cpp a smaller head than ours."""
    from sidecar.model.demo import ensure_demo_model

    demo = ensure_demo_model()
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) and f.name != "tokenizer.json":
            shutil.copy(f, out / f.name)
    tok = json.loads((demo / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"model: vocab_size {vocab_size} is below the demo tokenizer's {len(vocab)} tokens")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError("model: the demo tokenizer's ids are not contiguous")
    for i in range(len(vocab), vocab_size):
        vocab[f"<fill_{i}>"] = i
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def write_checkpoint(
    shape: dict[str, Any], out: Path, seed: int = 0, initializer_range: float = 0.02
) -> Path:
    """A random bfloat16 checkpoint of ``shape`` with its tokenizer, written to ``out`` (replaced)."""
    import torch
    import transformers

    cfg = build_config(shape, initializer_range)
    model_cls = getattr(transformers, FAMILIES[shape["family"]][1])
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    if shape["family"] == "gpt_oss":
        _write_gpt_oss(cfg, tmp)
    elif "num_experts" in shape:
        _write_moe(cfg, tmp)
    else:
        with torch.device("cpu"):
            model = model_cls(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        del model
    write_tokenizer(tmp, cfg.vocab_size)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def random_checkpoint(
    shape: str = "qwen2-0.5b", seed: int = 0, out: Optional[Path] = None, initializer_range: float = 0.02
) -> Path:
    """Build (once) a random bfloat16 checkpoint of the named shape (``SHAPES``), with its tokenizer."""
    if shape not in SHAPES:
        raise ValueError(f"model: unknown benchmark shape {shape!r} (known: {', '.join(SHAPES)})")
    out = Path(out) if out else bench_cache_dir() / f"{shape}-random-s{seed}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    return write_checkpoint(SHAPES[shape], out, seed, initializer_range)


def _write_moe(cfg: Any, out: Path) -> None:
    """A random bf16 Qwen3-MoE checkpoint in the hub's per-expert layout, written a layer per shard without
    building the model (the 12-layer cut holds 7.6B parameters)."""
    import torch
    from safetensors.torch import save_file

    shape = cfg.to_dict()
    shape["num_experts"] = cfg.num_experts  # to_dict names it num_local_experts
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


def _write_gpt_oss(cfg: Any, out: Path) -> None:
    """A random gpt-oss checkpoint as the published ones are laid out: bf16 attention (biases, a sink per
    head), router and expert biases, the experts' weights MXFP4 (``*_blocks`` uint8 [experts, out, in / 32, 16],
    ``*_scales`` e8m0 [experts, out, in / 32], weights up to 6 * 2^-8) under ``quantization_config.quant_method:
    mxfp4``; written a layer per shard without building the model."""
    import torch
    from safetensors.torch import save_file

    cfg.architectures = ["GptOssForCausalLM"]
    cfg.dtype = "bfloat16"
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, v, width, e = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_local_experts
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size) * 0.02).to(torch.bfloat16)

    def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8)
        return blocks, torch.randint(117, 121, (e, rows, cols // 32), dtype=torch.uint8)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch.bfloat16)

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": ones()})
    shard("head.safetensors", {"lm_head.weight": rand(v, h)})
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": ones(), f"{p}.post_attention_layernorm.weight": ones()}
        for name, rows, cols in (("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
            t[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, cols)
            t[f"{p}.self_attn.{name}_proj.bias"] = rand(rows)
        t[f"{p}.self_attn.sinks"] = rand(cfg.num_attention_heads)
        t[f"{p}.mlp.router.weight"], t[f"{p}.mlp.router.bias"] = rand(e, h), rand(e)
        for name, rows, cols in (("gate_up_proj", 2 * width, h), ("down_proj", h, width)):
            t[f"{p}.mlp.experts.{name}_blocks"], t[f"{p}.mlp.experts.{name}_scales"] = codes(rows, cols)
            t[f"{p}.mlp.experts.{name}_bias"] = rand(e, rows)
        shard(f"layer-{i:03d}.safetensors", t)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
