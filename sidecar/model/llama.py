"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over packed variable-length tokens.

The model sees one flat batch of ``T`` new tokens (all requests of a step
concatenated) with their positions; attention metadata tells each token which
KV blocks form its context. Projections are fused (qkv, gate+up) at load time.
Numerics follow Hugging Face transformers (RMSNorm in float32, rotate-half
RoPE, residual adds in the model dtype) so float32 greedy output matches it.

Device fast paths: the model owns one ``FastPaths`` (``fast_paths``) and every layer holds that same
instance; a layer takes the Triton form of a step (``kernels/triton/ops.py``, ``triton_attention.py``,
``triton_wo.py``) when ``fast_paths.takes(name, tensor)``, and otherwise the path it takes with every
field off. Fields are flipped in place on the shared instance, never by assigning a new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from sidecar.model.attention import AttentionMetadata, paged_attention, sdpa_backends
from sidecar.model.kernels.cpu import norm_act, rope_kv
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.linear import Linear, hooks_idle

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = (
            archs[0]
            if archs
            else {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM",
            }.get(cfg.get("model_type", ""), "")
        )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model: architecture {arch or cfg.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        # transformers 5 nests rope settings in rope_parameters; 4.x keeps rope_theta + rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_params and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        window = None
        if arch == "MistralForCausalLM":
            window = cfg.get("sliding_window")
        elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
            window = cfg.get("sliding_window")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def _triton(paths: Optional[FastPaths], name: str, t: torch.Tensor):
    """The Triton ops module when path ``name`` runs for ``t`` (``triton_gemv`` for ``gemv``), else None
    (imported only then)."""
    if paths is None or not paths.takes(name, t):
        return None
    if name == "gemv":
        from sidecar.model.kernels.triton import gemv as triton_gemv

        return triton_gemv
    from sidecar.model.kernels.triton import ops as triton_ops

    return triton_ops


def _plain(lin: nn.Module) -> bool:
    """A linear layer whose forward is ``F.linear`` on its own weight: no packed or quantized form, no hook that
    would change its output now (``hooks_idle``: LoRA's, outside a forward with adapter rows)."""
    return type(lin) is Linear and lin.weight is not None and hooks_idle(lin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast_paths = paths

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x). One pass on CPU."""
        ops = _triton(self.fast_paths, "norm", x)
        out = None if ops is None else ops.add_rms_norm(x, residual, self.weight, self.eps)
        return out if out is not None else norm_act.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.fast_paths = paths
        self.nh, self.nkv, self.hd = args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv_proj = Linear(args.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=args.attention_bias)
        self.o_proj = Linear(
            self.nh * self.hd,
            args.hidden_size,
            bias=args.attention_bias and args.architecture != "Qwen2ForCausalLM",
        )
        self.scale = self.hd**-0.5
        self.sliding_window = args.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``kv``: this layer's cache, (k, v) or a quantized (k, v, k_scale, v_scale) (see kv_quant)."""
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, kv, meta))

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rope, the KV write and attention over the fused projection ``qkv``: [T, heads * head_dim]."""
        t = qkv.shape[0]
        paths = self.fast_paths
        # With a quantized cache the rope + KV-write kernels quantize on write (Triton: int8 and fp8; CPU: int8);
        # otherwise paged_attention writes it through kv_quant.write after the torch rope.
        scales = kv[2:] if len(kv) == 4 else None
        ops = _triton(paths, "rope_kv", qkv)
        fused = None
        if ops is not None:
            fused = ops.rope_store_kv(
                qkv,
                cos,
                sin,
                meta.slot_mapping,
                kv[0],
                kv[1],
                self.nh,
                self.nkv,
                self.hd,
                want_k=bool(meta.prefills),
                kv_scales=scales,
            )
        if fused is None and meta.use_cpu_kernel:  # quantizes on write for an int8 cache
            fused = rope_kv.rope_store_kv(
                qkv,
                cos,
                sin,
                meta.slot_mapping,
                kv[0],
                kv[1],
                self.nh,
                self.nkv,
                self.hd,
                want_k=bool(meta.prefills),
                kv_scales=scales,
            )
        if fused is not None:  # rotated and written to the cache in one pass
            o = paged_attention(
                *fused,
                kv[0],
                kv[1],
                meta,
                self.scale,
                self.sliding_window,
                kv_written=True,
                paths=paths,
                kv_scales=scales,
            )
            return o.reshape(t, self.nh * self.hd)
        nqk = (self.nh + self.nkv) * self.hd
        # q and k are adjacent in the fused projection: rotate them in one pass.
        # rotate_half(x) == roll(x, hd/2) * [-1.., +1..]; the sign is folded into `sin` (see init_rope).
        qk = qkv[:, :nqk].view(t, self.nh + self.nkv, self.hd)
        qk = qk * cos + torch.roll(qk, self.hd // 2, dims=-1) * sin
        q, k = qk[:, : self.nh], qk[:, self.nh :]
        v = qkv[:, nqk:].view(t, self.nkv, self.hd)
        o = paged_attention(
            q, k, v, kv[0], kv[1], meta, self.scale, self.sliding_window, paths=paths, kv_scales=scales
        )
        return o.reshape(t, self.nh * self.hd)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.fast_paths = paths
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.gate_up_proj.gate_up_halves = args.intermediate_size
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(
            self.gate_up_proj, "silu_mul", None
        )  # our Linear's (tile layout); quantized layers lack it
        act = fused(x) if fused is not None else None
        if act is not None:
            return self.down_proj(act)
        gu = self.gate_up_proj(x)
        ops = _triton(self.fast_paths, "silu_mul", gu)
        act = None if ops is None else ops.silu_mul(gu)
        return self.down_proj(act if act is not None else norm_act.silu_mul(gu))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
        self.self_attn = Attention(args, paths)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
        self.mlp = MLP(args, paths)

    def forward(
        self,
        h: torch.Tensor,
        delta: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h`` arrives without the previous layer's output ``delta`` added (the add is
        fused into this layer's first norm); returns the stream and this layer's output, likewise."""
        ops = _triton(self.input_layernorm.fast_paths, "gemv", h)
        if ops is not None and self._fusable(
            ops, h, delta
        ):  # one row: four kernels, the norms and silu fused in
            attn, mlp = self.self_attn, self.mlp
            qkv, h = ops.norm_matmul(
                h,
                delta,
                self.input_layernorm.weight,
                self.input_layernorm.eps,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
            )
            o = ops.matmul(
                attn.attend(qkv, cos, sin, kv, meta).contiguous(), attn.o_proj.weight, attn.o_proj.bias
            )
            gu, h = ops.norm_matmul(
                h,
                o,
                self.post_attention_layernorm.weight,
                self.post_attention_layernorm.eps,
                mlp.gate_up_proj.weight,
                mlp.gate_up_proj.bias,
            )
            return h, ops.silu_matmul(gu, mlp.down_proj.weight, mlp.down_proj.bias)
        x, h = self.input_layernorm(h, delta)
        x, h = self.post_attention_layernorm(h, self.self_attn(x, cos, sin, kv, meta))
        return h, self.mlp(x)

    def _fusable(self, ops, h: torch.Tensor, delta: Optional[torch.Tensor]) -> bool:
        lins = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        return (
            all(_plain(lin) and ops.takes(h, lin.weight, lin.bias, lin.in_features) for lin in lins)
            and (
                delta is None or (delta.shape == h.shape and delta.dtype == h.dtype and delta.is_contiguous())
            )
            and all(n.weight.dtype == h.dtype for n in (self.input_layernorm, self.post_attention_layernorm))
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.fast_paths = FastPaths()  # all off: the runner's self-check turns paths on
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, self.fast_paths) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, self.fast_paths)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope_cos: Optional[torch.Tensor] = None
        self.rope_sin: Optional[torch.Tensor] = None

    def share_fast_paths(self) -> None:
        """Hands ``fast_paths`` to the modules swapped in after construction (quantized linears, which
        take it through ``set_fast_paths``). The loader calls it once the weights are in place."""
        for module in self.modules():
            if hasattr(module, "set_fast_paths"):
                module.set_fast_paths(self.fast_paths)

    def init_rope(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Precompute cos/sin for positions [0, max_positions) (float32 math, stored in the model dtype)."""
        inv_freq = rope_inv_freq(self.args).to(device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos().to(dtype)
        # Sign of rotate_half folded in: first half negated (exact in any dtype).
        sign = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
        self.rope_sin = (emb.sin() * sign).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        cos, sin = self.rope_rows(positions)
        return self.forward_embedded(self.embed_tokens(input_ids), cos, sin, kv_caches, meta)

    def rope_rows(
        self,
        positions: torch.Tensor,
        out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, head_dim] of ``positions`` [T]; written into ``out`` ([>= T, 1, head_dim] each)
        when given."""
        if out is None:
            return (
                self.rope_cos.index_select(0, positions)[:, None, :],
                self.rope_sin.index_select(0, positions)[:, None, :],
            )
        t = positions.shape[0]
        rows = []
        for table, buf in zip((self.rope_cos, self.rope_sin), out):
            torch.index_select(table, 0, positions, out=buf[:t, 0])
            rows.append(buf[:t])
        return rows[0], rows[1]

    def forward_embedded(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over embedded tokens ``h`` [T, hidden] with their rope rows (``rope_rows``): final hidden
        states [T, hidden]. On a CPU with our kernels every operation in it runs in one of them (what lets a
        decode step be replayed from C: ``engine/cpu_graphs.py``)."""
        delta = None
        with sdpa_backends(h.device):
            for layer, kv in zip(self.layers, kv_caches):
                h, delta = layer(h, delta, cos, sin, kv, meta)
        return self.norm(h, delta)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        widened = getattr(
            self.lm_head, "float_forward", None
        )  # our Linear's (tile layout); quantized heads lack it
        logits = widened(hidden) if widened is not None else None
        return logits if logits is not None else self.lm_head(hidden).float()
