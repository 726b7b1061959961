"""Write the two cached forms of a GGUF checkpoint (see gguf.py): full precision and exact int4."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sidecar.model import gguf_deepseek as deepseek
from sidecar.model import gguf_gemma4 as gemma4
from sidecar.model import gguf_gpt_oss as gpt_oss
from sidecar.model import gguf_llama4 as llama4
from sidecar.model import gguf_mistral4 as mistral4
from sidecar.model import gguf_qwen35 as qwen35
from sidecar.model import gguf_qwen3next as qwen3next
from sidecar.model import gguf_tensors as gt
from sidecar.model.quant_format import FORMAT_VERSION
from sidecar.model.quant_checkpoint import CONFIG_NAME, WEIGHTS_NAME

# Our fused linears and the GGUF projections they concatenate (along output rows); Phi-3's file holds them
# fused already (its ffn_up is gate and up).
_FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_FUSED_ARCH = {"phi3": {**_FUSED, "self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)}}
# Our norms in a decoder layer and the GGUF tensors they are (see loader.layer_norm_sources for the HF side).
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {**_NORMS, "attn_out_norm": "post_attention_norm", "mlp_out_norm": "post_ffw_norm"}
_QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_NORMS_ARCH = {
    "qwen3": {**_NORMS, **_QK_NORMS},
    "gemma2": _GEMMA_NORMS,
    "gemma3": {**_GEMMA_NORMS, **_QK_NORMS},
    "qwen3moe": {**_NORMS, **_QK_NORMS},
}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gguf_state_dict(reader, cfg: dict) -> dict[str, torch.Tensor]:
    """Every used tensor of the file in HF naming and layout (dequantized where block-quantized; MXFP4 expert
    tensors as codes, ``*_blocks`` and ``*_scales``)."""
    out = {}
    for t in reader.tensors:
        name = gt.hf_name(t.name, cfg["model_type"])
        if name is None:
            continue
        if gt.type_name(t) in gt.EXPERT_TYPES:  # codes as they are: gguf_gpt_oss.fix_state places them
            base = name.removesuffix(".weight")
            out[f"{base}.blocks"], out[f"{base}.scales"] = gt.mxfp4_codes(t)
            continue
        w = gt.dequantize(t)
        heads = gt.rope_heads(name, cfg)
        out[name] = gt.unpermute_rows(w, heads) if heads else w
    for name in [n for n in out if n.endswith(".mlp.experts.gate_proj.weight")]:
        block = name.removesuffix(".gate_proj.weight")  # transformers' fused layout (moe.expert_weights)
        out[f"{block}.gate_up_proj"] = torch.cat((out.pop(name), out.pop(f"{block}.up_proj.weight")), dim=1)
        out[f"{block}.down_proj"] = out.pop(f"{block}.down_proj.weight")
    if cfg["model_type"] in ("qwen35", "qwen35moe"):
        out = qwen35.fix_state(out, cfg)
    elif cfg["model_type"] == "qwen3next":
        out = qwen3next.fix_state(out, cfg)
    elif cfg["model_type"] == "gpt-oss":
        out = gpt_oss.fix_state(out, cfg)
    elif cfg["model_type"] == "llama4":
        out = llama4.fix_state(out, cfg)
    elif cfg["model_type"] == "deepseek2":
        out = deepseek.fix_state(out, cfg)
    elif cfg["model_type"] == "mistral4":
        out = mistral4.fix_state(out, cfg)
    elif cfg["model_type"] == "gemma4":
        out = gemma4.fix_state(out, cfg)
    return out


def write_fp(reader, cfg: dict, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in gguf_state_dict(reader, cfg).items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "source": "gguf"})


def _write_experts(tensors: dict, layer: int, state: dict[str, torch.Tensor]) -> list[str]:
    """A sparse layer's router (full precision) and its experts' projections, each expert's Q4 codes as an
    int4 module of its own (``layers.<i>.mlp.experts.<e>.gate_up_proj`` / ``down_proj``); returns them."""
    p = f"layers.{layer}.mlp"
    state[f"{p}.gate.weight"] = gt.dequantize(tensors[f"blk.{layer}.{gt.ROUTER}.weight"]).contiguous()
    gate, up, down = (gt.int4_exact(tensors[f"blk.{layer}.{part}.weight"]) for part in _EXPERTS)
    modules = []
    for e in range(gate[0].shape[0]):
        for ours, parts in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
            name = f"{p}.experts.{e}.{ours}"
            modules.append(name)
            for key, k in (("qweight", 0), ("scales", 1), ("zeros", 2)):
                state[f"{name}.{key}"] = torch.cat([x[k][e] for x in parts]).contiguous()
    return modules


def write_int4(reader, cfg: dict, out: Path) -> None:
    """Quantized checkpoint (our module naming) whose int4 codes are the file's Q4 codes."""
    from safetensors.torch import save_file

    tensors = {t.name: t for t in reader.tensors}
    state: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    arch = cfg["model_type"]
    for i in range(cfg["num_hidden_layers"]):
        sparse = f"blk.{i}.{gt.ROUTER}.weight" in tensors
        if sparse:
            modules += _write_experts(tensors, i, state)
        for ours, parts in _FUSED_ARCH.get(arch, _FUSED).items():
            if sparse and ours.startswith("mlp."):
                continue
            q, s, z, biases = [], [], [], []
            for part in parts:
                t = tensors[f"blk.{i}.{part}.weight"]
                heads = gt.rope_heads(gt.hf_name(t.name, arch), cfg)
                # Row permutations commute with the format: groups run along K, rows are independent.
                for acc, x in zip((q, s, z), gt.int4_exact(t)):
                    acc.append(gt.unpermute_rows(x, heads) if heads else x)
                bias = tensors.get(f"blk.{i}.{part}.bias")
                if bias is not None:
                    b = gt.dequantize(bias)
                    biases.append(gt.unpermute_rows(b, heads) if heads else b)
            name = f"layers.{i}.{ours}"
            modules.append(name)
            state[f"{name}.qweight"] = torch.cat(q).contiguous()
            state[f"{name}.scales"] = torch.cat(s).contiguous()
            state[f"{name}.zeros"] = torch.cat(z).contiguous()
            if biases:
                state[f"{name}.bias"] = torch.cat(biases).contiguous()
        for ours, part in _NORMS_ARCH.get(arch, _NORMS).items():  # Gemma's hold 1 + w: ours as they are
            state[f"layers.{i}.{ours}.weight"] = gt.dequantize(tensors[f"blk.{i}.{part}.weight"]).contiguous()
    emb = tensors["token_embd.weight"]
    state["norm.weight"] = gt.dequantize(tensors["output_norm.weight"]).contiguous()
    aliases, q8_tied = {}, None
    if "output.weight" in tensors:
        state["embed_tokens.weight"] = gt.dequantize(emb).contiguous()
        state["lm_head.weight"] = gt.dequantize(tensors["output.weight"]).contiguous()
    elif gt.type_name(emb) == "Q8_0":  # tied and Q8_0: kept as such (model/q8_0.py), a quarter of float32
        state["embed_tokens.q8_weight"], state["embed_tokens.q8_scales"] = gt.q8_0_exact(emb)
        q8_tied = "embed_tokens"
    else:
        state["embed_tokens.weight"] = gt.dequantize(emb).contiguous()
        aliases["lm_head.weight"] = "embed_tokens.weight"
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "source": "gguf"})
    qconfig = {
        "quant_method": "sidecar-weight-only",
        "format_version": FORMAT_VERSION,
        "mode": "int4",
        "group_size": gt.INT4_GROUP,
        "quantize_lm_head": False,
        "tied_embedding": None,
        "q8_0_tied_embedding": q8_tied,
        "modules": modules,
        "aliases": aliases,
        "dtype": cfg["torch_dtype"],
        "source": "gguf",
    }
    (out / CONFIG_NAME).write_text(json.dumps(qconfig, indent=2))
