"""``ModelArgs``: what the shared decoder (decoder.py, layers.py) needs to know of a checkpoint.

Each family file maps its Hugging Face config onto these fields (``args_from_config``); everything that
differs between families or between the layers of one model -- windows, rope kinds, attention scale and
soft-capping, extra norms, the activation -- is data here, read by the shared layer pieces.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from sidecar.model.latent_args import GroupedRouting, LatentAttention
from sidecar.model.rope import RopeSpec

# HF architecture -> the module (sidecar.model.<name>) that maps its config.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model; the vision tower is not loaded
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",  # its text model; the vision tower is not loaded
    "Qwen3NextForCausalLM": "qwen3_next",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",  # its text model; the vision tower is not loaded
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its text model; the vision and audio towers are not loaded
    "DeepseekV3ForCausalLM": "deepseek",
    "Mistral4ForCausalLM": "deepseek",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
}


@dataclass(frozen=True)
class LinearAttention:
    """The gated DeltaNet mixer's shape (deltanet.py): ``num_k_heads`` query/key heads of ``k_dim``, each
    serving ``num_v_heads / num_k_heads`` value heads of ``v_dim``; a depthwise causal convolution of
    ``conv_kernel`` taps over the concatenated q, k, v channels."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    def state_elements(self) -> tuple[int, int]:
        """Elements of one sequence's state in one layer: (conv window, recurrent matrix)."""
        return self.conv_dim * (self.conv_kernel - 1), self.num_v_heads * self.k_dim * self.v_dim


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: Optional[int]
    o_proj_bias: Optional[bool] = None  # None: attention_bias (Qwen2's o_proj has none)
    # Per layer: its window (None: global) and its rope kind (an index into rope_kinds). None: every layer
    # has ``sliding_window`` and kind 0.
    layer_windows: Optional[tuple[Optional[int], ...]] = None
    layer_rope: Optional[tuple[int, ...]] = None
    rope_kinds: Optional[tuple[RopeSpec, ...]] = None  # None: one kind from rope_theta / rope_scaling
    rotary_dim: Optional[int] = None  # channels of a head that rotate (None: all of head_dim)
    qk_norm: bool = False  # an RMSNorm over each q and k head before rope
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma)
    norm_unit_offset: bool = False  # checkpoint norms hold w and scale by (1 + w): the loader adds the one
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    embed_scale: Optional[float] = None  # embeddings multiplied by it (in the model dtype)
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_softcap: Optional[float] = None  # attention logits -> cap * tanh(logits / cap)
    final_softcap: Optional[float] = None  # the same on the output logits
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    # Mixture of experts (moe.py). 0 experts: every layer has the dense MLP. Otherwise every layer not in
    # ``dense_layers`` routes each token to ``experts_per_token`` of ``num_experts`` SwiGLU experts of width
    # ``expert_intermediate_size`` (the dense layers keep ``intermediate_size``).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to one
    # Mixtral weighs the experts' outputs by float32 routing weights; Qwen3-MoE casts them to the model dtype
    routing_weights_float32: bool = True
    # The checkpoint's names: the sparse block, then each expert's gate, up and down projections
    moe_names: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")
    # gpt-oss: the router's top-k logits softmaxed (instead of the top-k of a softmax over all experts), a
    # biased router and biased experts whose SwiGLU clamps (``swiglu_limit``: gate <= limit, |up| <= limit,
    # ``(up + 1) * gate * sigmoid(alpha * gate)``), stored in transformers' gpt-oss layout (moe.py); and a
    # learned logit per attention head in every softmax's denominator (``attn_sinks``).
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    attn_sinks: bool = False
    # Hybrid models (Qwen3.5): the layers whose mixer is a gated DeltaNet (a fixed-size state per sequence,
    # no KV cache) instead of attention, and its shape; the attention layers' output gated by a sigmoid of
    # a second projection of the layer input (q_proj holds it beside each head's query).
    linear_layers: tuple[int, ...] = ()
    linear: Optional[LinearAttention] = None
    attn_output_gate: bool = False
    # Attention layers of different shapes (Gemma 4): each layer's head size and KV heads (None: head_dim and
    # num_kv_heads everywhere), and the layer whose KV cache it reads: itself, or an earlier layer whose keys
    # and values it shares (None: its own). Only layers that read their own keep a cache.
    layer_head_dims: Optional[tuple[int, ...]] = None
    layer_kv_heads: Optional[tuple[int, ...]] = None
    kv_source: Optional[tuple[int, ...]] = None
    # Multi-head latent attention (mla.py) in every layer, and group-limited routing with shared experts
    # (grouped_moe.py) in the sparse ones: DeepSeek V3, Mistral 4
    latent: Optional[LatentAttention] = None
    routing: Optional[GroupedRouting] = None
    # where the decoder's tensors sit in the checkpoint (a multimodal one nests the text model deeper)
    checkpoint_prefix: str = "model."
    # Llama 4 (llama4.py, attention_local.py): per layer, the chunk its tokens attend within (a token at p sees
    # keys [p // chunk * chunk, p]; None: every key up to p); layers without rope (NoPE); rope rotating the
    # interleaved channel pairs (2i, 2i + 1); an L2 norm of each q and k head after rope on the rope layers;
    # on the NoPE layers q scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (the pair
    # ``attn_temperature``). Experts weighed by the sigmoid of their top-k router logits, applied to the
    # expert's input; a shared expert of width ``shared_expert_size`` (0: none) beside the routed ones, its
    # output scaled by the sigmoid of a one-output projection of the token where ``shared_expert_gate``
    # (Qwen3-Next, Qwen3.5-MoE).
    layer_chunks: Optional[tuple[Optional[int], ...]] = None
    nope_layers: tuple[int, ...] = ()
    interleaved_rope: bool = False
    qk_l2_norm: bool = False
    attn_temperature: Optional[tuple[float, float]] = None  # (floor_scale, attn_scale)
    router_sigmoid_input: bool = False
    shared_expert_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias and self.architecture != "Qwen2ForCausalLM"
        if self.rope_kinds is None:
            self.rope_kinds = (RopeSpec(self.rope_theta, self.rope_scaling),)
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"model: num_experts_per_tok {self.experts_per_token} must be between 1 and the "
                f"{self.num_experts} experts"
            )
        if self.num_experts and self.expert_intermediate_size <= 0:
            raise ValueError("model: a mixture-of-experts config needs the experts' intermediate size")

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    def chunk(self, layer: int) -> Optional[int]:
        return None if self.layer_chunks is None else self.layer_chunks[layer]

    def rope_kind(self, layer: int) -> int:
        return 0 if self.layer_rope is None else self.layer_rope[layer]

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer``'s mixer is linear attention (a state slot) rather than paged attention."""
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged cache, in order."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    def kv_shapes(self, layers: Optional[range] = None) -> list[tuple[int, int]]:
        """(KV heads, head size) of each layer that keeps a KV cache, in layer order: the attention layers (of
        ``layers`` where given, e.g. a pipeline stage's) but those reading another layer's cache
        (``kv_source``)."""
        src, hds, nkvs = self.kv_source, self.layer_head_dims, self.layer_kv_heads
        return [
            (self.num_kv_heads if nkvs is None else nkvs[i], self.head_dim if hds is None else hds[i])
            for i in self.attention_layers
            if (src is None or src[i] == i) and (layers is None or i in layers)
        ]

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), "")
        if arch not in FAMILIES:
            raise ValueError(
                f"model: architecture {arch or cfg.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        family = importlib.import_module(f"sidecar.model.{FAMILIES[arch]}")
        return family.args_from_config(cfg, arch)


def checkpoint_view(args: ModelArgs, ckpt: Any) -> Any:
    """``ckpt`` as the loader reads it: through the family's ``checkpoint_view`` where it has one (its own
    tensor names and layouts mapped onto the loader's), else as it is."""
    family = importlib.import_module(f"sidecar.model.{FAMILIES[args.architecture]}")
    view = getattr(family, "checkpoint_view", None)
    return ckpt if view is None else view(args, ckpt)


def rope_settings(cfg: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of a config: transformers 5 nests them in rope_parameters, 4.x keeps
    rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or None
    if params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    return float(theta), scaling


def base_args(cfg: dict[str, Any], arch: str, **extra: Any) -> ModelArgs:
    """The fields every family reads the same way; ``extra`` sets or overrides the rest."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = rope_settings(cfg)
    fields = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=None,
    )
    fields.update(extra)
    return ModelArgs(**fields)


def windows_from_layer_types(cfg: dict[str, Any]) -> Optional[tuple[Optional[int], ...]]:
    """Per-layer windows from ``layer_types`` ("sliding_attention" layers get ``sliding_window``)."""
    types = cfg.get("layer_types")
    if not types:
        return None
    window = cfg.get("sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)
