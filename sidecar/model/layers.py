"""Shared decoder layer pieces over packed variable-length tokens: RMSNorm, attention, MLP, the decoder layer.

Numerics follow Hugging Face transformers (RMSNorm in float32, rotate-half RoPE, residual adds in the model
dtype) so float32 greedy output matches it. What differs between families or between layers -- the window,
the rope kind, the attention scale and soft-cap, q/k norms, norms on the attention's and MLP's outputs,
the activation, partial rotary -- arrives as data (``ModelArgs`` and the layer index), never as a branch
on the family here.

Device fast paths: every layer holds the model's one ``FastPaths``; a layer takes the Triton form of a step
(``kernels/triton/ops.py``, ``attention.py``, ``gemv.py``) when ``fast_paths.takes(name, tensor)`` and the
layer's data allows it, and otherwise the path it takes with every field off.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model.attention import AttentionMetadata, paged_attention
from sidecar.model.deltanet import GatedDeltaNet
from sidecar.model.kernels.cpu import norm_act, rope_kv
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.linear import Linear, hooks_idle


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
    """``weight * rms_norm(x)``. A family whose checkpoint scales by ``(1 + w)`` (Gemma) gets ``1 + w`` in
    ``weight`` from the loader, added in float32: in float32 the product is HF's bit for bit."""

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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rope of ``x`` [T, heads, hd] over its first ``cos.shape[-1]`` channels (the rest pass
    through); ``sin`` carries rotate-half's sign (rope.py)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + torch.roll(x, rot // 2, dims=-1) * sin
    r = x[..., :rot]
    return torch.cat((r * cos + torch.roll(r, rot // 2, dims=-1) * sin, x[..., rot:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.fast_paths = paths
        self.nh, self.nkv, self.hd = args.num_heads, args.num_kv_heads, args.head_dim
        self.qkv_proj = Linear(args.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=args.attention_bias)
        self.o_proj = Linear(self.nh * self.hd, args.hidden_size, bias=args.o_proj_bias)
        self.scale = args.attn_scale if args.attn_scale is not None else self.hd**-0.5
        self.sliding_window = args.window(layer)
        self.softcap = args.attn_softcap
        self.rope_kind = args.rope_kind(layer)
        # [heads]: a learned logit per head that joins every softmax's denominator (gpt-oss), else None
        self.sinks = nn.Parameter(torch.zeros(self.nh), requires_grad=False) if args.attn_sinks else None
        # Qwen3.5: the output times sigmoid(gate_proj(x)), per channel, before o_proj
        self.gate_proj = (
            Linear(args.hidden_size, self.nh * self.hd, bias=args.attention_bias)
            if args.attn_output_gate
            else None
        )
        # Llama 4 (attention_local.py): its rope, post-rope L2 norms, NoPE temperature and chunks
        self.chunk, self.use_rope = args.chunk(layer), layer not in args.nope_layers
        self.l2_eps = args.rms_norm_eps if args.qk_l2_norm and self.use_rope else None
        self.temperature = None if self.use_rope else args.attn_temperature
        self.local_form = args.interleaved_rope or self.chunk is not None or bool(args.nope_layers)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.hd, args.rms_norm_eps, paths)
            self.k_norm = RMSNorm(self.hd, args.rms_norm_eps, paths)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``kv``: this layer's cache, (k, v) or a quantized (k, v, k_scale, v_scale) (see kv_quant);
        ``cos``, ``sin``: the step's rope rows of every kind ([kinds, T, 1, rotary_dim])."""
        o = self.attend(self.qkv_proj(x), cos, sin, kv, meta)
        return self.o_proj(o if self.gate_proj is None else norm_act.sigmoid_mul(o, self.gate_proj(x)))

    def _normed_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projection with each q and k head RMS-normed (HF: before rope), as one contiguous [T, .]. On CPU
        the heads are normed in place in the projection's own rows (no copy, so a decode step stays all kernel
        calls and replayable)."""
        t, nq, nk = qkv.shape[0], self.nh * self.hd, self.nkv * self.hd
        qn, kn = self.q_norm, self.k_norm
        if qkv.is_contiguous() and norm_act.rms_norm_heads_(qkv, 0, self.nh, self.hd, qn.weight, qn.eps):
            if not norm_act.rms_norm_heads_(qkv, nq, self.nkv, self.hd, kn.weight, kn.eps):
                qkv[:, nq : nq + nk] = kn(qkv[:, nq : nq + nk].reshape(t * self.nkv, self.hd))[0].view(t, nk)
            return qkv
        q = self.q_norm(qkv[:, :nq].reshape(t * self.nh, self.hd))[0].view(t, nq)
        k = self.k_norm(qkv[:, nq : nq + nk].reshape(t * self.nkv, self.hd))[0].view(t, nk)
        return torch.cat((q, k, qkv[:, nq + nk :]), dim=1)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rope, the KV write and attention over the fused projection ``qkv``: [T, heads * head_dim]."""
        if self.local_form:
            from sidecar.model import attention_local

            return attention_local.attend(self, qkv, cos, sin, kv, meta)
        t = qkv.shape[0]
        paths = self.fast_paths
        if self.q_norm is not None:
            qkv = self._normed_qkv(qkv)
        cos, sin = cos[self.rope_kind], sin[self.rope_kind]
        # With a quantized cache the rope + KV-write kernels quantize on write (Triton: int8 and fp8; CPU: int8);
        # otherwise paged_attention writes it through kv_quant.write after the torch rope. The CPU kernel rotates a
        # head's first channels where the tables are narrower than it (partial rotary); the Triton one refuses.
        scales = kv[2:] if len(kv) == 4 else None
        shape = (self.nh, self.nkv, self.hd)
        ops = _triton(paths, "rope_kv", qkv)
        fused = None
        if ops is not None:
            fused = ops.rope_store_kv(
                qkv, cos, sin, meta.slot_mapping, kv[0], kv[1], *shape, bool(meta.prefills), scales
            )
        if fused is None and meta.use_cpu_kernel:  # quantizes on write for an int8 cache
            fused = rope_kv.rope_store_kv(
                qkv, cos, sin, meta.slot_mapping, kv[0], kv[1], *shape, bool(meta.prefills), scales
            )
        window, cap = self.sliding_window, self.softcap
        if fused is not None:  # rotated and written to the cache in one pass
            o = paged_attention(
                *fused,
                kv[0],
                kv[1],
                meta,
                self.scale,
                window,
                True,
                paths,
                scales,
                softcap=cap,
                sinks=self.sinks,
            )
            return o.reshape(t, self.nh * self.hd)
        nqk = (self.nh + self.nkv) * self.hd
        # q and k are adjacent in the fused projection: rotate them in one pass.
        qk = rotate(qkv[:, :nqk].view(t, self.nh + self.nkv, self.hd), cos, sin)
        q, k = qk[:, : self.nh], qk[:, self.nh :]
        v = qkv[:, nqk:].view(t, self.nkv, self.hd)
        o = paged_attention(
            q,
            k,
            v,
            kv[0],
            kv[1],
            meta,
            self.scale,
            window,
            paths=paths,
            kv_scales=scales,
            softcap=cap,
            sinks=self.sinks,
        )
        return o.reshape(t, self.nh * self.hd)


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """GeGLU over the fused gate/up projection [T, 2I]: gelu_tanh(gate) * up, as HF's Gemma MLP (one pass on
    CPU)."""
    return norm_act.gelu_tanh_mul(gu)


def clamped_swiglu(gu: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation over the fused gate/up projection [T, 2I] (gate half first), as HF's:
    gate clamped above at ``limit``, up to [-limit, limit], ``(up + 1) * gate * sigmoid(gate * alpha)``."""
    gate, up = gu.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MLP(nn.Module):
    """``down(act(gate) * up)`` over a fused gate/up projection; ``act`` is silu, or tanh gelu (GeGLU), or
    with ``swiglu_limit`` set gpt-oss's clamped SwiGLU (``clamped_swiglu``)."""

    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.fast_paths = paths
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.gate_up_proj.gate_up_halves = args.intermediate_size
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        if args.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"model: activation {args.hidden_act!r} is not supported (silu, gelu_tanh)")
        self.silu = args.hidden_act == "silu"
        self.clamp = None if args.swiglu_limit is None else (args.swiglu_limit, args.swiglu_alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:  # no product kernel fuses the clamped form
            return self.down_proj(clamped_swiglu(self.gate_up_proj(x), *self.clamp))
        if not self.silu:  # GeGLU: no product kernel fuses gelu
            return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))
        # our Linear's fused gate/up + silu (tile layout); quantized layers lack it
        fused = getattr(self.gate_up_proj, "silu_mul", None)
        act = fused(x) if fused is not None else None
        if act is not None:
            return self.down_proj(act)
        gu = self.gate_up_proj(x)
        ops = _triton(self.fast_paths, "silu_mul", gu)
        act = None if ops is None else ops.silu_mul(gu)
        return self.down_proj(act if act is not None else norm_act.silu_mul(gu))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``; with ``sandwich_norms`` (Gemma) the
    attention's and the MLP's outputs are normed too (``attn_out_norm``, ``mlp_out_norm``) before their adds.
    ``post_attention_layernorm`` is always the norm in front of the MLP (HF Gemma's pre_feedforward_layernorm)."""

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        paths: Optional[FastPaths] = None,
        mlp: Optional[nn.Module] = None,
        attn: Optional[nn.Module] = None,
    ) -> None:
        """``mlp``: the layer's MLP where it is not the dense one (a mixture of experts, moe.py); ``attn``: its
        attention where it is not ``Attention`` (multi-head latent attention, mla.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
        # The mixer: paged attention, or a gated DeltaNet (deltanet.py) whose ``kv`` is its state slots
        linear = args.is_linear(layer)
        self.self_attn = None if linear else (attn if attn is not None else Attention(args, layer, paths))
        self.linear_attn = GatedDeltaNet(args) if linear else None
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
        self.mlp = MLP(args, paths) if mlp is None else mlp
        if args.sandwich_norms:
            self.attn_out_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
            self.mlp_out_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, paths)
        else:
            self.attn_out_norm = self.mlp_out_norm = None

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
        if self.linear_attn is not None or getattr(self.self_attn, "latent", False):
            ops = None
        if ops is not None and self._fusable(ops, h, delta):  # one row: four kernels, norms and silu fused in
            attn, mlp = self.self_attn, self.mlp
            ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
            qkv, h = ops.norm_matmul(h, delta, ln1.weight, ln1.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
            o = ops.matmul(
                attn.attend(qkv, cos, sin, kv, meta).contiguous(), attn.o_proj.weight, attn.o_proj.bias
            )
            gu, h = ops.norm_matmul(h, o, ln2.weight, ln2.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
            return h, ops.silu_matmul(gu, mlp.down_proj.weight, mlp.down_proj.bias)
        x, h = self.input_layernorm(h, delta)
        if self.linear_attn is not None:
            a = self.linear_attn(x, kv, meta)
        else:
            a = self.self_attn(x, cos, sin, kv, meta)
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)[0]
        x, h = self.post_attention_layernorm(h, a)
        m = self.mlp(x)
        return h, m if self.mlp_out_norm is None else self.mlp_out_norm(m)[0]

    def _fusable(self, ops, h: torch.Tensor, delta: Optional[torch.Tensor]) -> bool:
        """The fused one-row form covers the plain pre-norm block with a silu MLP only: a layer with output
        norms, a GeGLU MLP or a mixture of experts takes the unfused path."""
        mlp = self.mlp
        if self.attn_out_norm is not None or type(mlp) is not MLP or not mlp.silu or mlp.clamp is not None:
            return False
        if self.self_attn.gate_proj is not None:  # the gated output has no fused form
            return False
        lins = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        return (
            all(_plain(lin) and ops.takes(h, lin.weight, lin.bias, lin.in_features) for lin in lins)
            and (
                delta is None or (delta.shape == h.shape and delta.dtype == h.dtype and delta.is_contiguous())
            )
            and all(n.weight.dtype == h.dtype for n in (self.input_layernorm, self.post_attention_layernorm))
        )
