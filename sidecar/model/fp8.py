"""FP8 (e4m3) checkpoints: compressed-tensors ``float-quantized`` and the ``fp8`` method (fine-grained FP8).

Both store ``weight`` as float8_e4m3fn [N, K] and a float32 scale that multiplies it back: compressed-tensors
``weight_scale`` per tensor ([1]), per channel ([N, 1]) or per block ([ceil(N / bn), ceil(K / bk)],
``strategy: block``, ``block_structure``); the ``fp8`` method ``weight_scale_inv`` per block
(``weight_block_size``, usually [128, 128]) or per tensor. A block at the right or bottom edge may be partial;
its scale covers what there is.

CPU: the weight is dequantized once at load, ``fl32(w * scale)`` (the format's own dequantizer: e4m3 widened
to float32 exactly, one float32 product), then cast to the compute dtype, and runs through our ``Linear`` (the
bf16 kernels, oneDNN). That is exact against the dequantized model, for per-channel and block scales alike,
and the only exact choice that keeps our kernels: e4m3 spans 2^-9..448, which int8 codes cannot hold exactly,
so the int8 paths do not apply; keeping the e4m3 values as bf16 and scaling after the product costs the same
memory as the dequantized bf16 weight and rounds differently from it (the product ``w * s`` needs 28 bits);
splitting K by blocks multiplies the number of products. The activations are not quantized on CPU (a
weight-only FP8 path, as runtimes without FP8 units run these checkpoints).

CUDA with FP8 units (sm89+): per-tensor and per-channel weights run ``torch._scaled_mm`` on the e4m3 codes
with activations quantized to e4m3 per token (``Fp8ScaledLinear``), after a start-up self-check against the
dequantized product (``scaled_mm_check``); where the check fails or the scales are per block, the
dequantized path runs and the reason is logged once."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

log = logging.getLogger("sidecar.model")

E4M3_MAX = 448.0
_checked: dict[str, str] = {}  # device -> '' when _scaled_mm passed its self-check, else the reason


def parse_ct_fp8_scheme(group: dict, where: str) -> tuple[str, Optional[tuple[int, int]]]:
    """Check one compressed-tensors config group of the ``float-quantized`` format; returns (weight strategy,
    block shape or None). Raises ValueError naming the first field that does not fit."""
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights: {weights!r} is not supported (expected FP8 weight args)")
    w = f"{where}.weights"
    for field, allowed in (("num_bits", (8,)), ("type", ("float",)), ("symmetric", (True,))):
        if weights.get(field) not in allowed:
            raise ValueError(
                f"{w}.{field}: {weights.get(field)!r} is not supported (expected {allowed[0]!r})"
            )
    if weights.get("dynamic", False) is not False:
        raise ValueError(f"{w}.dynamic: {weights.get('dynamic')!r} is not supported (expected False)")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"{w}.strategy: {strategy!r} is not supported (expected tensor, channel or block)")
    block = None
    if strategy == "block":
        block = _block_shape(weights.get("block_structure"), f"{w}.block_structure")
    acts = group.get("input_activations")
    if acts is not None:
        a = f"{where}.input_activations"
        if not isinstance(acts, dict) or acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ValueError(f"{a}: {acts!r} is not supported (expected FP8 activations or none)")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: {group['output_activations']!r} is not supported")
    return strategy, block


def _block_shape(value, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"{where}: {value!r} is not supported (expected two positive integers)")
    return int(value[0]), int(value[1])


def parse_fp8_config(qcfg: dict) -> Optional[tuple[int, int]]:
    """Check a ``quant_method: fp8`` config; returns the weight block shape (None: one scale per tensor).
    Raises ValueError naming the field."""
    scheme = qcfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme: {scheme!r} is not supported (expected 'dynamic')"
        )
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (expected 'e4m3')")
    block = qcfg.get("weight_block_size")
    return None if block is None else _block_shape(block, "quantization_config.weight_block_size")


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """float32 ``w * scale`` of e4m3 codes [N, K]: ``scale`` one value, one a row ([N] or [N, 1]) or one a
    block ([ceil(N / bn), ceil(K / bk)] for ``block`` = (bn, bk), edge blocks partial)."""
    n, k = w.shape
    s = scale.float()
    if block is not None:
        bn, bk = block
        if tuple(s.shape) != (-(-n // bn), -(-k // bk)):
            raise ValueError(
                f"scale grid {tuple(s.shape)} does not fit a [{n}, {k}] weight in {bn}x{bk} blocks"
            )
        s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif s.numel() == n:
        s = s.reshape(n, 1)
    elif s.numel() != 1:
        raise ValueError(f"{s.numel()} scales do not fit a [{n}, {k}] weight (one, or one a row)")
    return w.float() * s.reshape(s.shape if s.dim() == 2 else (1, 1))


def quantize_per_token_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], float32 scales [M, 1]) of the rows of ``x``: scale absmax / 448 (a zero row: 1)."""
    s = x.float().abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


class Fp8ScaledLinear(nn.Module):
    """e4m3 weight [N, K] with float32 scales [N] through ``torch._scaled_mm`` (CUDA sm89+); per-token e4m3
    activations. Built only where ``scaled_mm_check`` passed on the device."""

    mode = "fp8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())  # row-major [N, K]: weight.t() is column-major
        self.register_buffer("scales", scales.float().reshape(1, -1).contiguous())
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        q, sx = quantize_per_token_e4m3(x2d)
        # bf16 out: the output dtype every rowwise-scaled _scaled_mm build takes.
        y = torch._scaled_mm(q, self.weight.t(), scale_a=sx, scale_b=self.scales, out_dtype=torch.bfloat16)
        y = y.to(x.dtype) if self.bias is None else y.to(x.dtype) + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def scaled_mm_self_check(device: torch.device) -> str:
    """'' where ``Fp8ScaledLinear`` runs on ``device`` and matches the dequantized product of the same e4m3
    activations and weights on a small problem (to float rounding), else what went wrong."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        w32 = torch.randn(48, 64, device=device, generator=g)
        sw = w32.abs().amax(dim=1) / E4M3_MAX
        w8 = (w32 / sw[:, None]).to(torch.float8_e4m3fn)
        x = torch.randn(17, 64, device=device, generator=g).to(torch.bfloat16)
        y = Fp8ScaledLinear(w8, sw, None)(x).float()
        q, sx = quantize_per_token_e4m3(x)
        ref = (q.float() * sx) @ dequantize(w8, sw, None).T
        err = float((y - ref).abs().max())
        if not err <= 1e-2 * float(ref.abs().max()):  # bf16 output rounding: 2^-8 of the largest
            return f"self-check: _scaled_mm differs from the dequantized product by {err}"
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"self-check: torch._scaled_mm failed ({type(exc).__name__}: {str(exc)[:200]})"
    return ""


def scaled_mm_check(device: torch.device) -> str:
    """'' where FP8 weights take ``Fp8ScaledLinear`` on ``device`` (CUDA with FP8 units, self-check passed),
    else the reason, logged once; checked once a device."""
    key = str(device)
    if key not in _checked:
        if device.type != "cuda":
            reason = f"{device.type} has no FP8 units"
        elif torch.cuda.get_device_capability(device) < (8, 9):
            reason = (
                f"compute capability {torch.cuda.get_device_capability(device)} below 8.9 has no FP8 units"
            )
        else:
            reason = scaled_mm_self_check(device)
        if reason:
            log.info("FP8 weights run dequantized on %s: %s", key, reason)
        _checked[key] = reason
    return _checked[key]


def load_linear_fp8(
    get: Callable[[str], torch.Tensor],
    prefixes: list[str],
    scale_name: str,
    block: Optional[tuple[int, int]],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """The runtime module of the projection stored under ``prefixes`` (rows concatenated for a fused one):
    ``Fp8ScaledLinear`` where the device passes ``scaled_mm_check`` and the scales are per tensor or row,
    else our ``Linear`` over the dequantized weight in ``dtype``. ``scale_name``: 'weight_scale' or
    'weight_scale_inv'."""
    from sidecar.model.linear import Linear

    codes, scales, deq = [], [], []
    fast = block is None and device.type == "cuda" and not scaled_mm_check(device)
    for p in prefixes:
        fast = fast and get(f"{p}.weight").shape[1] % 16 == 0  # _scaled_mm's operands: K a multiple of 16
    for p in prefixes:
        w = get(f"{p}.weight")
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"model: {p}.weight is {w.dtype}, FP8 checkpoints store float8_e4m3fn")
        s = get(f"{p}.{scale_name}")
        if fast:
            codes.append(w)
            scales.append(s.float().reshape(-1).expand(w.shape[0]))
        else:
            try:
                deq.append(dequantize(w, s, block).to(dtype))
            except ValueError as exc:
                raise ValueError(f"model: {p}.{scale_name}: {exc}") from None
    b = torch.cat([get(f"{p}.bias") for p in prefixes]).to(device=device, dtype=dtype) if bias else None
    if fast and sum(c.shape[0] for c in codes) % 16 == 0:  # and N
        return Fp8ScaledLinear(torch.cat(codes).to(device), torch.cat(scales).to(device), b)
    if fast:  # N not a multiple of 16: the dequantized weight after all
        deq = [dequantize(c, s, None).to(dtype) for c, s in zip(codes, scales)]
    weight = torch.cat(deq) if len(deq) > 1 else deq[0]
    linear = Linear(weight.shape[1], weight.shape[0], bias=bias, device="meta")
    linear.weight = nn.Parameter(weight.to(device), requires_grad=False)
    if b is not None:
        linear.bias = nn.Parameter(b, requires_grad=False)
    return linear
