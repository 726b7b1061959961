"""Gemma 4's decoder (config mapping: gemma4.py) over packed variable-length tokens, numerics as
transformers'.

Each layer: ``h + post_norm(attn(input_norm(h)))``; then ``h + post_ff_norm(mlp(pre_ff_norm(h)))`` where a MoE
layer's MLP output is ``post_ff_norm_1(mlp(.)) + post_ff_norm_2(experts(pre_ff_norm_2(h)))`` routed on ``h``;
then, with per-layer inputs, ``h + post_pl_norm(pl_proj(gelu(pl_gate(h)) * per_layer_input))``; the result
times the layer's ``layer_scalar``. A token's per-layer inputs: ``(norm(proj(embedding) / sqrt(hidden)) +
embed_per_layer(token) * sqrt(per_layer_dim)) / sqrt(2)``, one slice per layer.

KV cache: one ``(k, v)`` per layer that computes its own (``ModelArgs.kv_shapes``: each at its own KV heads
and head size); the forward's ``kv_caches`` are those, in layer order. A layer sharing another's keys and
values (``kv_source``) reads that layer's cache and, for the step's new tokens, the keys and values it just
computed, and writes nothing. Attention is ``paged_attention`` with the layer's window: its kernels take each
call's head size from the tensors and decline shapes they cannot do (the torch path then runs).

Norms here are transformers' Gemma 4 RMSNorm to the operation (``x * (mean(x^2) + eps) ** -0.5`` in float32, a
plain ``w``), so float32 greedy output equals transformers' ``generate``."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model import rope
from sidecar.model.attention import AttentionMetadata, paged_attention, sdpa_backends
from sidecar.model.decoder import CausalLM
from sidecar.model.gemma4 import Gemma4Args
from sidecar.model.layers import MLP, rotate
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE

log = logging.getLogger("sidecar.model")

# Why decode steps are not replayed from C (engine/cpu_graphs.py): a replay runs the decoder over staged
# inputs in our kernels alone. Each token's per-layer inputs could be staged beside its embedding (a lookup,
# a projection and a norm before the layers), but the layers themselves run torch operators a replay cannot
# record: Gemma 4's norms (``pow(mean + eps, -0.5)``; q, k and v heads), its rope over per-kind head widths,
# the GeGLU gate times the per-layer input, and the layer scalar.
REPLAY_REFUSAL = (
    "Gemma 4 layers read per-layer inputs and run torch operators a replay cannot record (their norms, rope, "
    "per-layer input gate and layer scalar)"
)


class Norm(nn.Module):
    """transformers' Gemma 4 RMSNorm: float32, ``pow(mean + eps, -0.5)``, times a plain weight (or none)."""

    def __init__(self, dim: int, eps: float, weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Gemma4Args, layer: int, paths) -> None:
        super().__init__()
        self.paths = paths
        self.nh, self.hd = args.num_heads, args.layer_head_dims[layer]
        self.nkv = args.layer_kv_heads[layer]
        self.window, self.rope_kind = args.window(layer), args.rope_kind(layer)
        self.owns_kv = args.kv_source[layer] == layer
        self.k_is_v = layer in args.kv_from_k_layers
        h, eps, bias = args.hidden_size, args.rms_norm_eps, args.attention_bias
        self.q_proj = Linear(h, self.nh * self.hd, bias=bias)
        self.q_norm = Norm(self.hd, eps)
        if self.owns_kv:
            self.k_proj = Linear(h, self.nkv * self.hd, bias=bias)
            self.v_proj = None if self.k_is_v else Linear(h, self.nkv * self.hd, bias=bias)
            self.k_norm = Norm(self.hd, eps)
            self.v_norm = Norm(self.hd, eps, weight=False)
        self.o_proj = Linear(self.nh * self.hd, h, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        shared: dict,
    ) -> torch.Tensor:
        """``shared``: rope kind -> this step's (k, v) of the last layer of that kind that computed its own
        (what a sharing layer attends with); ``kv``: the cache this layer reads."""
        t = x.shape[0]
        cos, sin = cos[self.rope_kind][..., : self.hd], sin[self.rope_kind][..., : self.hd]
        q = rotate(self.q_norm(self.q_proj(x).view(t, self.nh, self.hd)), cos, sin)
        if self.owns_kv:
            raw = self.k_proj(x).view(t, self.nkv, self.hd)
            v = raw if self.v_proj is None else self.v_proj(x).view(t, self.nkv, self.hd)
            k, v = rotate(self.k_norm(raw), cos, sin), self.v_norm(v)
            shared[self.rope_kind] = (k, v)
        else:
            k, v = shared[self.rope_kind]
        scales = kv[2:] if len(kv) == 4 else None
        o = paged_attention(
            q,
            k,
            v,
            kv[0],
            kv[1],
            meta,
            1.0,
            self.window,
            kv_written=not self.owns_kv,
            paths=self.paths,
            kv_scales=scales,
        )
        return self.o_proj(o.reshape(t, self.nh * self.hd))


class Experts(SparseMoE):
    """Gemma 4's routed experts (GeGLU ``MLP`` s, ``SparseMoE``'s dispatch). The router reads the layer's
    stream: normed without a weight, times ``scale / sqrt(hidden)``, projected (``gate``), softmaxed in
    float32; the top k renormalised and times their ``per_expert_scale``."""

    def __init__(self, args: Gemma4Args, paths) -> None:
        super().__init__(args, paths)
        self.router_norm = Norm(args.hidden_size, args.rms_norm_eps, weight=False)
        self.scale = nn.Parameter(torch.ones(args.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(args.num_experts), requires_grad=False)
        self.root = args.hidden_size**-0.5
        self.router_input: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.router_norm(self.router_input) * self.scale * self.root
        probs = torch.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def routed(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """The experts over ``x`` [T, hidden], routed on ``stream`` [T, hidden]."""
        self.router_input = stream
        try:
            return self(x)
        finally:
            self.router_input = None


class DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4Args, layer: int, paths) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer, paths)
        wide = 2 if layer in args.wide_mlp_layers else 1
        self.mlp = MLP(replace(args, intermediate_size=wide * args.intermediate_size), paths)
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"]
        norms.append("post_feedforward_layernorm")
        self.experts = Experts(args, paths) if args.num_experts else None
        if self.experts is not None:
            norms += [
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ]
        if args.per_layer_dim:
            self.per_layer_input_gate = Linear(h, args.per_layer_dim, bias=False)
            self.per_layer_projection = Linear(args.per_layer_dim, h, bias=False)
            norms.append("post_per_layer_input_norm")
        self.norm_names = tuple(norms)
        for name in norms:
            setattr(self, name, Norm(h, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, h, per_layer, cos, sin, kv, meta, shared) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv, meta, shared)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts is not None:
            e = self.experts.routed(self.pre_feedforward_layernorm_2(h), h)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(m)
        if per_layer is not None:
            g = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar


def build(args: Gemma4Args) -> "Gemma4CausalLM":
    """The decoder ``args`` describe (the loader's hook: ``Gemma4Args.decoder_module``)."""
    return Gemma4CausalLM(args)


class Gemma4CausalLM(CausalLM):
    replay_refusal = REPLAY_REFUSAL

    def __init__(self, args: Gemma4Args) -> None:
        nn.Module.__init__(self)
        self.args = args
        from sidecar.model.kernels.gpu_paths import FastPaths

        self.fast_paths = FastPaths()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.fast_paths) for i in range(args.num_layers))
        self.norm = Norm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        p = args.per_layer_dim
        if p:
            self.embed_tokens_per_layer = nn.Embedding(args.per_layer_vocab, args.num_layers * p)
            self.per_layer_model_projection = Linear(args.hidden_size, args.num_layers * p, bias=False)
            self.per_layer_projection_norm = Norm(p, args.rms_norm_eps)
        owners = [i for i in range(args.num_layers) if args.kv_source[i] == i]
        self.cache_index = [owners.index(args.kv_source[i]) for i in range(args.num_layers)]
        self.rope_cos: Optional[torch.Tensor] = None
        self.rope_sin: Optional[torch.Tensor] = None
        self.rope_rows_per_half = 0

    def init_rope(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """cos/sin [kinds, positions, widest head] (``CausalLM.rope_rows``): each kind in the first columns of
        its own head size (its layers slice them), its frequencies as transformers computes them."""
        a = self.args
        width = max(a.rope_dims)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        cos = torch.ones(len(a.rope_kinds), max_positions, width, device=device)
        sin = torch.zeros_like(cos)
        for k, (spec, dim) in enumerate(zip(a.rope_kinds, a.rope_dims)):
            c, s = rope._cos_sin(inv_freq(spec, dim).to(device), pos, 1.0)
            cos[k, :, :dim], sin[k, :, :dim] = c, s
        self.rope_cos, self.rope_sin = cos.to(dtype), sin.to(dtype)
        self.rope_rows_per_half = max_positions
        if device.type == "cpu":
            log_kernel_refusals(a)

    @property
    def rope_long_from(self) -> Optional[int]:
        return None

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
        """[T, layers, per_layer_dim] (module docstring), or None without per-layer inputs."""
        a, p = self.args, self.args.per_layer_dim
        if not p:
            return None
        t = input_ids.shape[0]
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = tokens * torch.tensor(p**0.5, dtype=torch.float32).to(tokens.dtype)
        proj = self.per_layer_model_projection(h) * a.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(t, a.num_layers, p))
        return (proj + tokens.view(t, a.num_layers, p)) * 2.0**-0.5

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = self.rope_rows(positions)
        h = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, h)
        shared: dict = {}
        with sdpa_backends(h.device):
            for i, layer in enumerate(self.layers):
                pl = None if per_layer is None else per_layer[:, i]
                h = layer(h, pl, cos, sin, kv_caches[self.cache_index[i]], meta.for_layer(i), shared)
        return self.norm(h)

    def forward_embedded(self, h, cos, sin, kv_caches, meta):
        raise NotImplementedError(REPLAY_REFUSAL)

    def load_checkpoint(
        self, get: Callable[[str], torch.Tensor], put: Callable, quantize: Optional[Callable] = None
    ) -> None:
        """Fill every weight from the checkpoint (``get(name)``; ``put(module, attr, tensor)`` sets one, shape
        checked, in the model dtype and device). ``quantize(part)``, where the weights are quantized on load,
        swaps a filled part's linears for int8 / int4 ones: each layer as it is filled, then the whole model
        (the head, a tied embedding, the per-layer model projection)."""
        a, top = self.args, self.args.checkpoint_prefix
        put(self.embed_tokens, "weight", get(f"{top}embed_tokens.weight"))
        if a.per_layer_dim:
            put(self.embed_tokens_per_layer, "weight", get(f"{top}embed_tokens_per_layer.weight"))
            put(self.per_layer_model_projection, "weight", get(f"{top}per_layer_model_projection.weight"))
            put(self.per_layer_projection_norm, "weight", get(f"{top}per_layer_projection_norm.weight"))
        for i, layer in enumerate(self.layers):
            p = f"{top}layers.{i}"
            attn = layer.self_attn
            names = ["q_proj", "o_proj"] + (["k_proj"] if attn.owns_kv else [])
            names += ["v_proj"] if attn.owns_kv and attn.v_proj is not None else []
            for name in names:
                put(getattr(attn, name), "weight", get(f"{p}.self_attn.{name}.weight"))
                if a.attention_bias:
                    put(getattr(attn, name), "bias", get(f"{p}.self_attn.{name}.bias"))
            for name in ("q_norm", "k_norm") if attn.owns_kv else ("q_norm",):
                put(getattr(attn, name), "weight", get(f"{p}.self_attn.{name}.weight"))
            mlp = f"{p}.mlp"
            gu = torch.cat((get(f"{mlp}.gate_proj.weight"), get(f"{mlp}.up_proj.weight")))
            put(layer.mlp.gate_up_proj, "weight", gu)
            put(layer.mlp.down_proj, "weight", get(f"{mlp}.down_proj.weight"))
            for name in layer.norm_names:
                put(getattr(layer, name), "weight", get(f"{p}.{name}.weight"))
            if a.per_layer_dim:
                for name in ("per_layer_input_gate", "per_layer_projection"):
                    put(getattr(layer, name), "weight", get(f"{p}.{name}.weight"))
            put(layer, "layer_scalar", get(f"{p}.layer_scalar"))
            if layer.experts is not None:
                ex = layer.experts
                put(ex.gate, "weight", get(f"{p}.router.proj.weight"))
                put(ex, "scale", get(f"{p}.router.scale"))
                put(ex, "per_expert_scale", get(f"{p}.router.per_expert_scale"))
                gate_up, down = get(f"{p}.experts.gate_up_proj"), get(f"{p}.experts.down_proj")
                for e, expert in enumerate(ex.experts):
                    put(expert.gate_up_proj, "weight", gate_up[e])
                    put(expert.down_proj, "weight", down[e])
            if quantize is not None:
                quantize(layer)
        put(self.norm, "weight", get(f"{top}norm.weight"))
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            put(self.lm_head, "weight", get("lm_head.weight"))
        if quantize is not None:
            quantize(self)


def inv_freq(spec: rope.RopeSpec, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim / 2] of a Gemma 4 rope kind over a head of ``dim``: the default rope, or the
    "proportional" one (the first ``partial_rotary_factor`` of the pairs turn at the default rope's
    frequencies over ``dim``, the others not at all; all divided by ``factor``)."""
    if spec.kind == "default":
        return rope.inv_freq(spec, dim)
    s = spec.scaling
    angles = int(s.get("partial_rotary_factor", 1.0) * dim // 2)
    turned = 1.0 / (spec.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    freq = torch.cat((turned, torch.zeros(dim // 2 - angles)))
    return freq / s.get("factor", 1.0)


def log_kernel_refusals(args: Gemma4Args) -> list[str]:
    """Log (and return) why the CPU attention kernels decline some layers' head sizes: those layers attend on
    the torch path. The Triton decode kernel pads every head size to a power of two and takes them all."""
    from sidecar.model.kernels.cpu import paged_attention as cpu_kernel

    width = cpu_kernel.vector_width()
    reasons = []
    for hd in sorted(set(args.layer_head_dims)):
        layers = [i for i, d in enumerate(args.layer_head_dims) if d == hd]
        if width is None:
            reasons.append(f"layers {layers}: the CPU attention kernels are not built here")
        elif hd % width or hd > cpu_kernel.MAX_HEAD_DIM:
            reasons.append(
                f"layers {layers}: the CPU attention kernels take head sizes that are multiples of {width} "
                f"up to {cpu_kernel.MAX_HEAD_DIM}, not {hd}"
            )
    for why in reasons:
        log.info("attention on the torch path for %s", why)
    return reasons
