"""The gated delta rule of a DeltaNet mixer (model/deltanet.py) in torch, over float32 recurrent states: the
chunked form a prompt chunk runs and the one-token recurrence of a decode step, each as Hugging Face's torch
fallbacks compute it (the same ops in the same order), so float32 greedy output equals HF's ``generate``.

On CPU a prompt chunk's rule runs in C instead where that kernel passed its self-check (``kernel_rule``,
kernels/cpu/deltanet_step.c): the same recurrence token by token, which differs from the chunked form only in
the order of float32 sums, and costs a fraction of it (no triangular solves, no per-block torch ops). On CUDA
it runs in Triton where that kernel passed its self-check (``triton_rule``, kernels/triton/deltanet_chunk.py):
the chunked form itself, one launch per chunk, the blocks' matrix products at float32 precision.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from sidecar.model.kernels.cpu import deltanet_step
from sidecar.model.kernels.gpu_paths import triton_kernel_ready

CHUNK = 64  # tokens per block of the chunked rule (HF's chunk_size)
log = logging.getLogger("sidecar.model")
# why a prompt kernel is off ('' when on), once asked: "reason" the C one, "triton:<device type>" Triton's
_checked: dict[str, str] = {}


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(nv: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """[B, L, heads, d] (or [B, L, heads]) -> float32 [B, nv, L, ...], key heads repeated to the value
    heads they serve."""
    out = []
    for x in xs:
        if x.dim() == 4 and x.shape[2] != nv:
            x = x.repeat_interleave(nv // x.shape[2], dim=2)
        out.append(x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format))
    return out


def chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over a prompt chunk. q, k: [B, L, k_heads, k_dim]; v: [B, L, v_heads, v_dim]; g, beta:
    [B, L, v_heads]; state: [B, v_heads, k_dim, v_dim] float32 before the chunk. Returns (o [B, L, v_heads,
    v_dim] in v's dtype, the state after the chunk, float32)."""
    dtype, (b, length, nv, dv) = v.dtype, v.shape
    q, k, v, beta, g = _heads_first(nv, q, k, v, beta, g)
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, nv, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, nv, -1, CHUNK).cumsum(dim=3)  # decay from the block's start, log space
    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (g.unsqueeze(4) - g.unsqueeze(3)).masked_fill(above, float("-inf")).exp()  # decay j -> i
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(
        system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    s = state.to(new_v)
    out = torch.zeros_like(new_v)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    block_decay = g[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        u = new_v[:, :, i] - k_decay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ u
        s = s * block_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, nv, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule for each of B sequences: q, k [B, 1, k_heads, k_dim], v [B, 1, v_heads, v_dim],
    g, beta [B, 1, v_heads], state [B, v_heads, k_dim, v_dim] float32. Returns (o [B, 1, v_heads, v_dim],
    the new state)."""
    dtype, nv = v.dtype, v.shape[2]
    q, k, v, beta, g = _heads_first(nv, q, k, v, beta, g)
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    q, k, v, beta, g = q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], g[:, :, 0]
    s = state.to(v) * g.exp()[..., None, None]
    remembered = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - remembered) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (s * q.unsqueeze(-1)).sum(dim=-2)
    return o[:, None].to(dtype), s


def kernel_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> Optional[torch.Tensor]:
    """``chunked_rule`` of one sequence on the C kernel: q, k [L, k_heads, k_dim]; v [L, v_heads, v_dim]; g,
    beta [L, v_heads]; state [v_heads, k_dim, v_dim] float32, advanced in place. Returns o [L, v_heads,
    v_dim] in v's dtype; None (nothing touched) where the kernel is off or does not take them."""
    if q.device.type != "cpu" or not rule_ready():
        return None
    return _on_kernel(deltanet_step.rule, q, k, v, g, beta, state)


def triton_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> Optional[torch.Tensor]:
    """``kernel_rule`` on the Triton prompt kernel (kernels/triton/deltanet_chunk.py), on the tensors' device
    (CUDA; CPU under the interpreter); None (nothing touched) where it is off there or does not take them."""
    if not triton_rule_ready(q.device):
        return None
    return _on_kernel(triton_prompt_rule(), q, k, v, g, beta, state)


def _on_kernel(rule, q, k, v, g, beta, state) -> Optional[torch.Tensor]:
    """``rule`` (a prompt kernel over normed float32 inputs) on the mixer's q, k, v, g, beta; o in v's dtype."""
    dtype = v.dtype
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q / (q.shape[-1] ** 0.5)
    v, g, beta = (x.float().contiguous() for x in (v, g, beta))  # a float32 view is not copied by .to
    o = rule(q.contiguous(), k.contiguous(), v, g, beta, state)
    return None if o is None else o.to(dtype)


def _rule_check(rule=None, device: str = "cpu") -> str:
    """'' when the prompt kernel ``rule`` (the C one by default, or the Triton ``rule`` of the same arguments)
    on ``device`` agrees with ``chunked_rule`` on CPU over a chunk longer than a block, grouped key heads and
    a value head size off the kernel's column block (the state read back and advanced); else why not."""
    gen = torch.Generator().manual_seed(0)
    length, nk, nv, dk, dv = 70, 2, 4, 20, 40
    q, k = torch.randn(length, nk, dk, generator=gen), torch.randn(length, nk, dk, generator=gen)
    v = torch.randn(length, nv, dv, generator=gen)
    g, beta = -torch.rand(length, nv, generator=gen), torch.rand(length, nv, generator=gen)
    s0 = torch.randn(nv, dk, dv, generator=gen) * 0.3
    want_o, want_s = chunked_rule(q[None], k[None], v[None], g[None], beta[None], s0[None])
    state = s0.to(device, copy=True)
    qn, kn = (l2norm(q) / dk**0.5).contiguous(), l2norm(k).contiguous()
    got = (rule or deltanet_step.rule)(*(x.to(device) for x in (qn, kn, v, g, beta)), state)
    if got is None:
        return "the kernel refused a float32 chunk"
    for what, x, y in (("output", got, want_o[0]), ("state", state, want_s[0])):
        err, bound = float((x.cpu() - y).abs().max()), 1e-5 * (1 + float(y.abs().max()))
        if not err <= bound:
            return f"{what} off from the chunked rule by {err:.3g} (bound {bound:.3g})"
    return ""


def rule_ready() -> bool:
    """The C prompt rule is built here and passed its self-check (once; a failure is logged, and prompt chunks
    then take the torch chunked form)."""
    if "reason" not in _checked:
        _checked["reason"] = "" if deltanet_step.available() else "not built"
        _checked["reason"] = _checked["reason"] or _rule_check()
        if _checked["reason"]:
            log.warning("gated DeltaNet prompt kernel off, prompt chunks on torch: %s", _checked["reason"])
    return not _checked["reason"]


def triton_rule_ready(device: torch.device) -> bool:
    """The Triton prompt rule is installed and passed its self-check on ``device``'s type (once; a failure is
    logged, and prompt chunks then take the torch chunked form)."""
    return triton_kernel_ready(
        _checked,
        f"triton:{device.type}",
        device,
        lambda: _rule_check(triton_prompt_rule(), str(device)),
        "gated DeltaNet Triton prompt kernel off, prompt chunks on torch",
    )


def triton_prompt_rule():
    from sidecar.model.kernels.triton import deltanet_chunk  # imports Triton: only when asked

    return deltanet_chunk.rule
