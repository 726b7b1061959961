"""Gated DeltaNet: the linear-attention mixer of hybrid models (Qwen3.5), over packed variable-length tokens.

Per token: one projection gives the q, k, v channels, the output gate ``z``, ``b`` (beta = sigmoid(b), the
update's strength) and ``a`` (the decay ``g = A * softplus(a + dt_bias)`` with ``A = -exp(A_log)``, in log
space). The q, k, v channels pass a depthwise causal convolution of ``conv_kernel`` taps and silu; q and k
are L2-normed per head, q scaled by ``k_dim ** -0.5``; then, per value head, with state ``S`` [k_dim, v_dim]::

    S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  o = S^T q

and the output is an RMSNorm of ``o`` per head times silu(z), projected back to the hidden size.

State: a sequence owns one state slot (engine/linear_state.py) holding, for every linear layer, its last
``conv_kernel - 1`` convolution inputs ([slots, conv_dim, kernel - 1], the model dtype) and ``S``
([slots, v_heads, k_dim, v_dim], float32). A prompt chunk (``PrefillSegment.state_slot``) starts from its
slot's state and leaves its final state there; decode rows (``AttentionMetadata.decode_state_slots``, the
last rows of the batch, one token of a distinct sequence each) gather their slots, step once, and scatter
back, reading the slot ids on the device only (a captured decode graph steps the slots its buffers name at
replay; its padded rows all name one scratch row, engine/linear_state.py). The engine zeroes a slot when it
hands it out, so a sequence's first chunk starts from rest.

Numerics follow Hugging Face's torch fallbacks: prompt chunks use the chunked form of the rule (blocks of
``CHUNK`` tokens, the within-block part solved as a triangular system), decode rows the one-token recurrence,
as HF's prefill and decode do (deltanet_rule.py); so float32 greedy output equals HF's ``generate``. Prompt
 chunks take the C chunk on CPU where it passed its self-check (deltanet_prefill.py ``kernel_chunk``: the
convolution, the C rule and the gated norm over the in_proj rows in place), else the torch form, whose rule
is the Triton chunked form on CUDA (``triton_rule``, kernels/triton/deltanet_chunk.py) or the C one on CPU
where each passed its own check (deltanet_rule.py ``kernel_rule``). Decode
rows take a kernel where one passed its self-check: the C one on CPU (kernels/cpu/deltanet_step.c), the Triton
one on CUDA (kernels/triton/deltanet.py); else the torch reference.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model.attention import AttentionMetadata
from sidecar.model.deltanet_prefill import causal_conv, gated_norm, kernel_chunk, torch_chunk
from sidecar.model.deltanet_rule import kernel_rule, recurrent_step, triton_rule
from sidecar.model.kernels.cpu import deltanet_step
from sidecar.model.kernels.gpu_paths import triton_interpreted, triton_kernel_ready
from sidecar.model.linear import Linear

log = logging.getLogger("sidecar.model")
# why a decode kernel is off ('' when on), once asked: "reason" the C one, "triton:<device type>" Triton's
_checked: dict[str, str] = {}
_triton_on_cpu = {"decode": False, "prompt": False}  # use_triton_on_cpu


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of one layer; its ``state`` argument is the layer's (conv, recurrent) slot
    tensors (module docstring)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        spec = args.linear
        self.nk, self.nv, self.dk, self.dv = spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim
        self.kernel = spec.conv_kernel
        self.conv_dim = spec.conv_dim
        self.splits = [self.conv_dim, self.nv * self.dv]  # qkv, z
        self.in_proj = Linear(args.hidden_size, sum(self.splits), bias=False)
        # b and a stay apart: a product this narrow fused with the wide one is summed in another order
        self.in_proj_b = Linear(args.hidden_size, self.nv, bias=False)
        self.in_proj_a = Linear(args.hidden_size, self.nv, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, self.kernel))  # depthwise taps
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        # the decay rate -exp(A_log), float32 whatever the model dtype (set by load_hybrid_mixer)
        self.A = nn.Parameter(torch.zeros(self.nv))
        self.norm_weight = nn.Parameter(torch.ones(self.dv))  # plain w (not 1 + w)
        self.eps = args.rms_norm_eps
        self.out_proj = Linear(self.nv * self.dv, args.hidden_size, bias=False)

    def _conv(self, x: torch.Tensor, window: Optional[torch.Tensor]) -> torch.Tensor:
        """deltanet_prefill.causal_conv by this layer's taps."""
        return causal_conv(x, self.conv_weight, window)

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length = mixed.shape[:2]
        kd = self.nk * self.dk
        q, k, v = torch.split(mixed, [kd, kd, self.nv * self.dv], dim=-1)
        return (
            q.reshape(b, length, self.nk, self.dk),
            k.reshape(b, length, self.nk, self.dk),
            v.reshape(b, length, self.nv, self.dv),
        )

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        proj, b, a = self.in_proj(x), self.in_proj_b(x), self.in_proj_a(x)
        slots: Optional[torch.Tensor] = meta.decode_state_slots
        n = 0 if slots is None else slots.shape[0]
        fused = self._decode_kernel(proj[t - n :], b[t - n :], a[t - n :], state, slots) if n else None
        ref = t if fused is None else t - n  # the rows the torch reference runs (decode rows last)
        if not ref:  # decode rows alone, all on the kernel
            return self.out_proj(fused)
        gated = torch.empty(t, self.nv * self.dv, dtype=x.dtype, device=x.device)
        if fused is not None:
            gated[ref:] = fused
        mixed, z = torch.split(proj[:ref], self.splits, dim=1)
        beta = b[:ref].sigmoid()
        g = self.A * F.softplus(a[:ref].float() + self.dt_bias)
        out = torch.empty(ref, self.nv, self.dv, dtype=x.dtype, device=x.device)
        todo = []  # the rows whose rule output ``out`` holds, not yet gated
        for seg in meta.prefills:
            rows, slot = slice(seg.q_start, seg.q_start + seg.q_len), seg.state_slot
            args = (g[rows], beta[rows], state[0][slot], state[1][slot], bool(seg.state_start))
            done = (
                None if self._triton_prompts(proj) else kernel_chunk(self, proj[rows], *args)
            )  # C: all three
            if done is None:
                out[rows] = torch_chunk(self, proj[rows], *args, rule=self._prompt_kernel)
                todo.append(rows)
            else:
                gated[rows] = done
        if fused is None and n:
            rows = slice(t - n, t)
            out[rows] = self._decode_rows(mixed[rows], g[rows], beta[rows], *state, slots)
            todo.append(rows)
        for rows in todo:
            gated[rows] = self._gated_norm(out[rows], z[rows].reshape(-1, self.nv, self.dv)).flatten(1)
        return self.out_proj(gated)

    @staticmethod
    def _triton_prompts(x: torch.Tensor) -> bool:
        """Whether prompt chunks take the Triton rule: on CUDA, and on CPU under the interpreter when
        ``use_triton_on_cpu`` takes prompts (the C chunk is then skipped)."""
        return x.is_cuda or (x.device.type == "cpu" and _triton_on_cpu["prompt"] and triton_interpreted())

    def _prompt_kernel(self, q, k, v, g, beta, state) -> Optional[torch.Tensor]:
        """A prompt chunk's rule output [L, v_heads, v_dim] from a kernel (``state``, the slot's, advanced in
        place): the Triton one on CUDA (or on CPU under the interpreter when ``use_triton_on_cpu`` takes
        prompts), the C one on CPU; None (nothing touched) where it is off or does not take them."""
        if self._triton_prompts(q):
            return triton_rule(q, k, v, g, beta, state)
        return kernel_rule(q, k, v, g, beta, state)

    def _decode_rows(self, mixed, g, beta, conv_state, rec_state, slots: torch.Tensor) -> torch.Tensor:
        """The torch reference of a decode step: the rule's output [B, v_heads, v_dim] for B sequences' one
        token each (``mixed`` [B, conv_dim]), their slots' states advanced."""
        seq = mixed[:, :, None]  # [B, conv_dim, 1]
        window = conv_state.index_select(0, slots)
        qkv = self._conv(seq, window)
        conv_state.index_copy_(0, slots, torch.cat((window, seq), dim=-1)[:, :, -(self.kernel - 1) :])
        o, s = recurrent_step(*self._split(qkv), g[:, None], beta[:, None], rec_state.index_select(0, slots))
        rec_state.index_copy_(0, slots, s)
        return o[:, 0]

    def _decode_kernel(self, proj, b, a, state, slots) -> Optional[torch.Tensor]:
        """The gated output of the decode rows from a kernel (their states advanced): the Triton one on CUDA
        (or on CPU under the interpreter when ``use_triton_on_cpu``), the C one on CPU; None (nothing
        touched) where it is missing, failed its self-check, or does not take the arguments."""
        if proj.is_cuda or (proj.device.type == "cpu" and _triton_on_cpu["decode"] and triton_interpreted()):
            if not triton_ready(proj.device):
                return None
            return kernel_step(self, proj, b, a, state, slots, triton_step())
        if proj.device.type != "cpu" or not kernel_ready():
            return None
        return kernel_step(self, proj, b, a, state, slots)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """deltanet_prefill.gated_norm by this layer's weight."""
        return gated_norm(o, z, self.norm_weight, self.eps)


def load_hybrid_mixer(layer: nn.Module, ckpt, prefix: str, put) -> None:
    """Fill a hybrid model's decoder ``layer``'s mixer from the checkpoint tensors under ``prefix``
    (``ckpt.get(name)``, ``name in ckpt``): its gated DeltaNet, or its gated attention (q_proj split into the
    query rows, fused with k and v, and the gate rows). ``put(module, attr, tensor)`` sets a parameter
    (shape-checked, in the model dtype and device). The DeltaNet's decay rate is ``-exp(A_log)`` of
    ``A_log`` in the model dtype (as HF computes it), or a GGUF file's ``A`` (that rate, stored)."""
    get = ckpt.get
    if layer.linear_attn is not None:
        m, p = layer.linear_attn, f"{prefix}.linear_attn"
        put(m.in_proj, "weight", torch.cat([get(f"{p}.in_proj_{x}.weight") for x in ("qkv", "z")]))
        put(m.in_proj_b, "weight", get(f"{p}.in_proj_b.weight"))
        put(m.in_proj_a, "weight", get(f"{p}.in_proj_a.weight"))
        put(m, "conv_weight", get(f"{p}.conv1d.weight").squeeze(1))
        for ours, theirs in (("dt_bias", "dt_bias"), ("norm_weight", "norm.weight")):
            put(m, ours, get(f"{p}.{theirs}"))
        stored = f"{p}.A" in ckpt
        put(m, "A", get(f"{p}.A" if stored else f"{p}.A_log"))
        rate = get(f"{p}.A").float() if stored else -m.A.float().exp()
        m.A = nn.Parameter(rate.to(m.A.device), requires_grad=False)
        put(m.out_proj, "weight", get(f"{p}.out_proj.weight"))
        return
    attn, p = layer.self_attn, f"{prefix}.self_attn"
    for kind in ("weight", "bias") if attn.qkv_proj.bias is not None else ("weight",):
        q, gate = split_gated_query(get(f"{p}.q_proj.{kind}"), attn.nh, attn.hd)
        put(attn.qkv_proj, kind, torch.cat((q, get(f"{p}.k_proj.{kind}"), get(f"{p}.v_proj.{kind}"))))
        put(attn.gate_proj, kind, gate)
    put(attn.o_proj, "weight", get(f"{p}.o_proj.weight"))
    if attn.o_proj.bias is not None:
        put(attn.o_proj, "bias", get(f"{p}.o_proj.bias"))


def split_gated_query(q_proj: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's gated-attention q_proj rows hold each head's query then its gate ([heads, 2, head_dim, .]): the
    (query rows, gate rows), each [heads * head_dim, .]."""
    w = q_proj.reshape(heads, 2, head_dim, *q_proj.shape[1:])
    return w[:, 0].reshape(heads * head_dim, -1).squeeze(-1), w[:, 1].reshape(heads * head_dim, -1).squeeze(
        -1
    )


def random_mixer(heads: tuple[int, int, int, int], kernel: int, dtype: torch.dtype, gen) -> GatedDeltaNet:
    """A mixer of ``heads`` (k_heads, v_heads, k_dim, v_dim) with random convolution taps, decay rates, biases
    and norm weights (its projections left out: ``decode_reference`` takes their rows)."""
    m = GatedDeltaNet.__new__(GatedDeltaNet)
    nn.Module.__init__(m)
    m.nk, m.nv, m.dk, m.dv = heads
    m.kernel, m.eps = kernel, 1e-6
    m.conv_dim = 2 * m.nk * m.dk + m.nv * m.dv
    m.splits = [m.conv_dim, m.nv * m.dv]
    for name, value in (
        ("conv_weight", (torch.randn(m.conv_dim, kernel, generator=gen) * 0.5).to(dtype)),
        ("dt_bias", torch.rand(m.nv, generator=gen).to(dtype)),
        ("A", -torch.rand(m.nv, generator=gen)),
        ("norm_weight", (1 + 0.3 * torch.randn(m.dv, generator=gen)).to(dtype)),
    ):
        setattr(m, name, nn.Parameter(value, requires_grad=False))
    return m


def decode_reference(m: GatedDeltaNet, proj, b, a, state, slots) -> torch.Tensor:
    """The torch reference of ``deltanet_step.decode``: the gated output rows [B, v_heads * v_dim] of B
    sequences' one token each from their in_proj, in_proj_b and in_proj_a rows; the slots' states advanced."""
    n = proj.shape[0]
    mixed, z = torch.split(proj, m.splits, dim=1)
    g = m.A * F.softplus(a.float() + m.dt_bias)
    o = m._decode_rows(mixed, g, b.sigmoid(), *state, slots)
    return m._gated_norm(o, z.reshape(n, m.nv, m.dv)).reshape(n, -1)


def kernel_step(m: GatedDeltaNet, proj, b, a, state, slots, step=None) -> Optional[torch.Tensor]:
    """``step`` (``deltanet_step.decode`` by default, or the Triton ``decode`` of the same arguments) over
    mixer ``m``'s parameters (None where it does not take them)."""
    w = (m.conv_weight, m.A, m.dt_bias, m.norm_weight)
    heads = (m.nk, m.nv, m.dk, m.dv)
    return (step or deltanet_step.decode)(proj, b, a, state[0], *w, m.eps, state[1], slots, heads)


def _self_check(step=None, device: str = "cpu") -> str:
    """'' when the decode kernel ``step`` (``kernel_step``'s) on ``device`` agrees with the torch reference,
    run on CPU (no TF32 convolution there), over both dtypes, grouped key heads, head sizes off the vector
    width, three sequences at scattered slots and two steps (a state it wrote read back); else why not."""
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([4, 0, 2])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        ref = random_mixer((2, 4, 20, 12), 4, dtype, gen)
        m = copy.deepcopy(ref).to(device)
        conv = torch.randn(5, m.conv_dim, m.kernel - 1, generator=gen).to(dtype)
        rec = torch.randn(5, m.nv, m.dk, m.dv, generator=gen) * 0.3
        ours, theirs = (conv.to(device, copy=True), rec.to(device, copy=True)), (conv, rec)
        for _ in range(2):
            proj = torch.randn(3, m.conv_dim + m.nv * m.dv, generator=gen).to(dtype)
            b, a = (torch.randn(3, m.nv, generator=gen).to(dtype) for _ in range(2))
            got = kernel_step(m, *(x.to(device) for x in (proj, b, a)), ours, slots.to(device), step)
            if got is None:
                return f"the kernel refused a {dtype} step"
            with torch.no_grad():
                want = decode_reference(ref, proj, b, a, theirs, slots)
            for what, x, y in zip(("output", "window", "state"), (got, *ours), (want, *theirs)):
                err, bound = (
                    float((x.cpu().float() - y.float()).abs().max()),
                    tol * (1 + float(y.float().abs().max())),
                )
                if not err <= bound:
                    return f"{dtype} {what} off from the torch reference by {err:.3g} (bound {bound:.3g})"
    return ""


def kernel_ready() -> bool:
    """The decode kernel is built here and passed its self-check (once; a failure is logged, and decode rows
    then take the torch reference)."""
    if "reason" not in _checked:
        why = "" if deltanet_step.available() else "not built"
        _checked["reason"] = why or _self_check()
        if _checked["reason"]:
            log.warning("gated DeltaNet decode kernel off, decode rows on torch: %s", _checked["reason"])
    return not _checked["reason"]


def use_triton_on_cpu(decode: bool, prompts: bool = False) -> None:
    """Run decode rows (and prompt chunks' rule) on CPU through the Triton kernels when Triton is interpreted
    (tests without a GPU)."""
    _triton_on_cpu["decode"], _triton_on_cpu["prompt"] = decode, prompts


def triton_ready(device: torch.device) -> bool:
    """The Triton decode kernel is installed and passed its self-check on ``device``'s type (once, before any
    graph capture; a failure is logged, and decode rows then take the torch reference)."""
    return triton_kernel_ready(
        _checked,
        f"triton:{device.type}",
        device,
        lambda: _self_check(triton_step(), str(device)),
        "gated DeltaNet Triton decode kernel off, decode rows on torch",
    )


def triton_step():
    from sidecar.model.kernels.triton import deltanet as triton_deltanet  # imports Triton: only when asked

    return triton_deltanet.decode
