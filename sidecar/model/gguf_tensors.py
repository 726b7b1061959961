"""GGUF tensors -> torch tensors in Hugging Face layout (names, shapes, rotary order).

``gguf.GGUFReader`` gives each tensor as a numpy view of the memory-mapped file:
float types as [rows, cols] arrays, block-quantized types as [rows, bytes per
row] uint8. ``gguf.quants.dequantize`` turns any supported type into float32.

Q4_0 and Q4_1 rows are additionally decoded *without* dequantizing into our int4
stored format (quant.py: ``w = (code - 8) * scale + zero``, group 32, low nibble
= even column): a GGUF block of 32 weights is exactly one group.
- Q4_1 block: f16 d, f16 m, 16 bytes of codes; w = d * q + m  -> scale = d, zero = m + 8 d.
- Q4_0 block: f16 d, 16 bytes of codes;        w = d * (q - 8) -> scale = d, zero = 0.
In both, byte j of the codes holds element j (low nibble) and element j + 16 (high nibble).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from sidecar.model.gguf_deepseek import LAYER_NAMES as DEEPSEEK_NAMES
from sidecar.model.gguf_gemma4 import LAYER_NAMES as GEMMA4_NAMES
from sidecar.model.gguf_gpt_oss import LAYER_NAMES as GPT_OSS_NAMES
from sidecar.model.gguf_llama4 import LAYER_NAMES as LLAMA4_NAMES
from sidecar.model.gguf_mistral4 import LAYER_NAMES as MISTRAL4_NAMES
from sidecar.model.gguf_qwen35 import LAYER_NAMES as QWEN35_NAMES
from sidecar.model.gguf_qwen3next import LAYER_NAMES as QWEN3NEXT_NAMES

# Types we read; anything else is rejected by name before conversion starts.
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
EXACT_INT4_TYPES = ("Q4_0", "Q4_1")
# Read for expert tensors only (gpt-oss): their codes kept as they are (mxfp4_codes)
EXPERT_TYPES = ("MXFP4",)
INT4_GROUP = 32

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # A sparse block: the router, and each projection of every expert in one 3D tensor [experts, out, in]
    # (gguf_convert fuses gate and up into transformers' ``experts.gate_up_proj``)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
ROUTER = "ffn_gate_inp"  # kept in full precision in every converted form
# Where an architecture's names differ: Gemma's norm in front of the MLP is HF's pre_feedforward_layernorm
# (its post_attention_layernorm norms the attention's output); Phi-3 stores q/k/v and gate/up fused.
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen35": QWEN35_NAMES,
    # Qwen3.5-MoE: Qwen3.5's layers with a sparse block and its gated shared expert
    "qwen35moe": {
        **QWEN35_NAMES,
        **{k: _LAYER_NAMES[k] for k in (ROUTER, "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")},
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    "qwen3next": QWEN3NEXT_NAMES,
    "gpt-oss": GPT_OSS_NAMES,
    "llama4": LLAMA4_NAMES,
    "deepseek2": DEEPSEEK_NAMES,
    "mistral4": MISTRAL4_NAMES,
    "gemma4": GEMMA4_NAMES,
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}


def hf_name(gguf_name: str, arch: Optional[str] = None) -> Optional[str]:
    """HF parameter name for a GGUF tensor name of architecture ``arch``, or None for tensors we do not use
    (e.g. rope_freqs; Phi-3's rope_factors_* are read as metadata)."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):  # a parameter without a suffix (Qwen3.5's ssm_a)
        base, kind = gguf_name, ""
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        mapped = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES).get(part)
        return None if mapped is None else f"model.layers.{idx}.{mapped}" + (f".{kind}" if kind else "")
    mapped = _TOP_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{kind}"


def type_name(tensor) -> str:
    return tensor.tensor_type.name


def check_types(reader, path: str) -> None:
    """Raise ValueError naming the first tensor whose type we cannot read."""
    for t in reader.tensors:
        name = type_name(t)
        if name in EXPERT_TYPES and "_exps." not in t.name:
            raise ValueError(
                f"model: {path}: tensor {t.name!r} has GGUF type {name}, which is supported for expert "
                "tensors (*_exps) only"
            )
        if name not in FLOAT_TYPES + BLOCK_TYPES + EXPERT_TYPES:
            raise ValueError(
                f"model: {path}: tensor {t.name!r} has GGUF type {name}, which is not supported "
                f"(supported: {', '.join(FLOAT_TYPES + BLOCK_TYPES + EXPERT_TYPES)})"
            )


def mxfp4_codes(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor [..., rows, cols] as the HF checkpoint holds it (mxfp4.py): ``blocks`` uint8
    [..., rows, cols / 32, 16] and ``scales`` uint8 [..., rows, cols / 32], equal to the file's values.

    ggml's block of 32 is one e8m0 byte ``e`` then 16 bytes ``qs``: ``qs[j]`` holds element j (low nibble)
    and element j + 16 (high nibble), each an e2m1 code whose table ggml doubles while halving the scale
    (``2 ** (e - 128)``), so ``e`` is the HF scale byte as it is. HF's byte k holds element 2k (low nibble)
    and 2k + 1 (high): the codes are only reordered within their block."""
    raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
    raw = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)
    scales, qs = raw[..., 0].contiguous(), raw[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., groups, 32]: element order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), scales


def rope_heads(hf: str, cfg: dict) -> Optional[int]:
    """Head count whose rotary rows llama.cpp's converter interleaved in this tensor, else None.

    For llama-arch models the converter reorders each q/k head's rows from HF's
    rotate-half layout (first half, second half) to GGML's pairwise layout; Qwen2
    is stored unpermuted.
    """
    if cfg["model_type"] not in ("llama", "mistral"):
        return None
    if ".self_attn.q_proj." in hf:
        return cfg["num_attention_heads"]
    if ".self_attn.k_proj." in hf:
        return cfg["num_key_value_heads"]
    return None


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's per-head row interleave: GGML row 2i (+1) of a head is HF row i (+ half)."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as a torch tensor [rows, cols] (or [n] for vectors).

    Float types keep their dtype (BF16 arrives as raw uint16 and is reinterpreted);
    block types are dequantized to float32.
    """
    import gguf

    name = type_name(tensor)
    data = tensor.data
    if name == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: the file is mapped read-only
    if name == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if name == "BF16":
        raw = torch.from_numpy(np.array(data).view(np.int16))
        return raw.view(torch.bfloat16)
    return torch.from_numpy(
        np.ascontiguousarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
    )


def int4_exact(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 tensor -> (qweight uint8 [N, K/2], scales f32 [N, K/32], zeros f32 [N, K/32]); a 3D
    tensor (experts) gives them per expert: [E, N, K/2], [E, N, K/32], [E, N, K/32].

    Codes are copied bit for bit; scales and zeros are the file's f16 values in float32.
    """
    name = type_name(tensor)
    raw = np.ascontiguousarray(tensor.data)
    lead = raw.shape[:-1]
    raw = raw.reshape(-1, raw.shape[-1])
    n = raw.shape[0]
    block_bytes = 20 if name == "Q4_1" else 18
    blocks = raw.reshape(n, -1, block_bytes)
    groups = blocks.shape[1]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if name == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        zeros = m + 8.0 * d
        qs = blocks[..., 4:]
    else:
        zeros = torch.zeros_like(d)
        qs = blocks[..., 2:]
    qs = torch.from_numpy(qs.copy())  # [N, G, 16]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, groups * INT4_GROUP)  # element order
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return tuple(x.reshape(*lead, x.shape[-1]).contiguous() for x in (qweight, d, zeros))


def q8_0_exact(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 tensor -> (codes int8 [N, K], scales f32 [N, K/32]): the file's blocks of 32, w = d * q,
    codes copied bit for bit and d (f16) in float32."""
    raw = np.ascontiguousarray(tensor.data)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, -1)
    return codes.contiguous(), d.contiguous()
