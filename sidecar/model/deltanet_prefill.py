"""A gated DeltaNet prompt chunk (model/deltanet.py): the torch form, and its C form on CPU.

The torch form of one sequence's chunk: the causal convolution of its q, k, v channels and silu
(``causal_conv``), the rule (deltanet_rule.py: the C recurrence ``kernel_rule`` where it passed its check,
else HF's chunked form) and the gated RMSNorm of its output (``gated_norm``). In bf16 that is some thirty torch
ops over the whole chunk, most making a float32 copy of it, and torch's depthwise convolution over the
transposed in_proj rows.

The C form (``kernel_chunk``, kernels/cpu/deltanet_prefill.c around deltanet_step.c's rule) reads the
in_proj rows in place: one pass convolves, applies silu and norms q and k into float32 rows the rule reads as
they are; the rule writes float32; one pass norms and gates it into the dtype. It rounds where the torch form
rounds, and its convolution sums are torch's to the bit; it differs from the torch form only in silu's exp,
the order of the norms' float32 sums, and the rule's (the C recurrence's against HF's chunked form). It runs
where it passed a start-up self-check against the torch form (``kernel_ready``; a failure is logged, and
chunks then take the torch form).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from sidecar.model.deltanet_rule import chunked_rule, kernel_rule, rule_ready
from sidecar.model.kernels.cpu import deltanet_prefill, deltanet_step

log = logging.getLogger("sidecar.model")
_checked: dict[str, str] = {}  # "reason": why the C chunk is off ('' when on), once asked


def causal_conv(x: torch.Tensor, weight: torch.Tensor, window: Optional[torch.Tensor]) -> torch.Tensor:
    """silu of the causal convolution of ``x`` [B, conv_dim, L] by the depthwise taps ``weight`` [conv_dim,
    kernel] after ``window`` [B, conv_dim, kernel-1] (the inputs before it; None: a sequence's start, zeros
    before it), as [B, L, conv_dim]. A start is convolved with zero padding, as HF's prefill does (the same
    sums, in the same order). The sums run in float32 and round to the dtype once, as torch's bf16
    convolution rounds them (whose CPU path is many times slower than the float32 one)."""
    conv_dim, kernel = weight.shape
    w = weight.unsqueeze(1).float()
    if window is None:
        out = F.conv1d(x.float(), w, None, padding=kernel - 1, groups=conv_dim)[:, :, : x.shape[-1]]
    else:
        out = F.conv1d(torch.cat((window, x), dim=-1).float(), w, None, padding=0, groups=conv_dim)
    return F.silu(out.to(weight.dtype)).to(x.dtype).transpose(1, 2)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output ``o`` [..., v_dim] (float32, back to the dtype, times ``weight``) times
    silu(z)."""
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(o.dtype)
    return (h * F.silu(z.float())).to(o.dtype)


def torch_chunk(m, proj: torch.Tensor, g, beta, window, state, start: bool, rule=kernel_rule) -> torch.Tensor:
    """The torch form of mixer ``m``'s prompt chunk of one sequence: the rule's output [L, v_heads, v_dim]
    (not yet gated) from its in_proj rows ``proj`` [L, conv_dim + ...], ``g``, ``beta`` [L, v_heads];
    ``window`` [conv_dim, kernel - 1] and ``state`` [v_heads, k_dim, v_dim] float32 advanced in place. ``rule``: a
    kernel's rule (None where it does not take the chunk, nothing touched), else HF's chunked form."""
    length, w = proj.shape[0], m.kernel - 1
    seq = proj[:, : m.conv_dim].t()[None]  # [1, conv_dim, L]
    qkv = causal_conv(seq, m.conv_weight, None if start else window[None])[0]
    window.copy_(torch.cat((window, seq[0, :, -w:]), dim=-1)[:, -w:])  # the last w inputs
    kd = m.nk * m.dk
    q, k, v = torch.split(qkv, [kd, kd, m.nv * m.dv], dim=-1)
    q, k, v = q.reshape(length, m.nk, m.dk), k.reshape(length, m.nk, m.dk), v.reshape(length, m.nv, m.dv)
    o = rule(q, k, v, g, beta, state)  # state in place
    if o is None:
        o, s = chunked_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
        state.copy_(s[0])
        o = o[0]
    return o


def kernel_chunk(m, proj: torch.Tensor, g, beta, window: torch.Tensor, state: torch.Tensor, start: bool):
    """``torch_chunk`` followed by the gated norm with ``z`` (proj's columns after the q, k, v channels), in C:
    the gated rows [L, v_heads * v_dim] in proj's dtype; None (nothing touched) where the kernels are off or
    do not take the arguments."""
    if proj.device.type != "cpu" or not kernel_ready():
        return None
    return _run(m, proj, g, beta, window, state, start)


def _run(m, proj, g, beta, window, state, start) -> Optional[torch.Tensor]:
    saved = window.clone()
    y = deltanet_prefill.conv(proj, window, m.conv_weight, start, (m.nk, m.dk))
    if y is None:
        return None
    kd, length = m.nk * m.dk, proj.shape[0]
    q = y[:, :kd].view(length, m.nk, m.dk)
    k = y[:, kd : 2 * kd].view(length, m.nk, m.dk)
    v = y[:, 2 * kd : 2 * kd + m.nv * m.dv].view(length, m.nv, m.dv)
    o = deltanet_step.rule(q, k, v, g.float().contiguous(), beta.float().contiguous(), state)
    if o is None:
        window.copy_(saved)
        return None
    z = proj[:, m.conv_dim : m.conv_dim + m.nv * m.dv]
    out = deltanet_prefill.gate(o, z, m.norm_weight, m.eps)
    if out is None:  # the state is advanced: finish in torch
        zh = z.reshape(length, m.nv, m.dv)
        out = gated_norm(o.to(proj.dtype), zh, m.norm_weight, m.eps).reshape(length, -1)
    return out


def _close(what: str, x: torch.Tensor, y: torch.Tensor, tol: float) -> str:
    err, bound = float((x.float() - y.float()).abs().max()), tol * (1 + float(y.float().abs().max()))
    return "" if err <= bound else f"{what} off from the torch form by {err:.3g} (bound {bound:.3g})"


def _self_check() -> str:
    """'' when the C chunk agrees with the torch form: the convolution's float32 sums to the bit (from a
    window and from a start), then whole chunks (gated rows, window, state) in both dtypes over grouped key
    heads, head sizes off the vector width and a chunk longer than the rule's blocks; else why not."""
    gen = torch.Generator().manual_seed(0)
    nk, nv, dk, dv, kernel, length = 2, 4, 20, 12, 4, 70
    conv_dim = 2 * nk * dk + nv * dv
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        m = SimpleNamespace(nk=nk, nv=nv, dk=dk, dv=dv, kernel=kernel, conv_dim=conv_dim, eps=1e-6)
        m.conv_weight = (torch.randn(conv_dim, kernel, generator=gen) * 0.5).to(dtype)
        m.norm_weight = (1 + 0.3 * torch.randn(dv, generator=gen)).to(dtype)
        proj = torch.randn(length, conv_dim + nv * dv, generator=gen).to(dtype)
        g, beta = -torch.rand(length, nv, generator=gen), torch.rand(length, nv, generator=gen).to(dtype)
        window = torch.randn(conv_dim, kernel - 1, generator=gen).to(dtype)
        state = torch.randn(nv, dk, dv, generator=gen) * 0.3
        for start in (True, False):
            sums = deltanet_prefill.conv(proj, window.clone(), m.conv_weight, start, act=False)
            seq = proj[:, :conv_dim].t()[None].float()
            w = m.conv_weight.unsqueeze(1).float()
            if start:
                want = F.conv1d(seq, w, None, padding=kernel - 1, groups=conv_dim)[:, :, :length]
            else:
                want = F.conv1d(torch.cat((window[None].float(), seq), -1), w, None, groups=conv_dim)
            if sums is None:
                return f"the kernel refused a {dtype} convolution"
            if dtype == torch.float32 and not torch.equal(sums, want[0].t()):
                return "float32 convolution sums differ from torch's bits"
            ours, theirs = (window.clone(), state.clone()), (window.clone(), state.clone())
            got = _run(m, proj, g, beta, *ours, start)
            if got is None:
                return f"the kernel refused a {dtype} chunk"
            with torch.no_grad():
                o = torch_chunk(m, proj, g, beta, *theirs, start)
                z = proj[:, conv_dim:].reshape(length, nv, dv)
                ref = gated_norm(o, z, m.norm_weight, m.eps).reshape(length, -1)
            if not torch.equal(ours[0], theirs[0]):
                return f"{dtype} window differs from the torch form's"
            why = _close(f"{dtype} output", got, ref, tol) or _close(
                f"{dtype} state", ours[1], theirs[1], tol
            )
            if why:
                return why
    return ""


def kernel_ready() -> bool:
    """The C chunk's kernels are built here, the C rule passed its own check, and the chunk passed its
    self-check (once; a failure is logged, and prompt chunks then take the torch form)."""
    if "reason" not in _checked:
        why = "" if deltanet_prefill.available() else "not built"
        why = why or ("" if rule_ready() else "the C rule is off")
        _checked["reason"] = why or _self_check()
        if _checked["reason"]:
            log.warning("gated DeltaNet C prompt chunk off, prompt chunks on torch: %s", _checked["reason"])
    return not _checked["reason"]
