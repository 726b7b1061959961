"""compressed-tensors ``int-quantized`` W8A8: int8 weights with one scale a row, int8 activations quantized
per token.

The format as llm-compressor writes it: each targeted linear stores ``weight`` (int8 [N, K], symmetric, no
zero point) and ``weight_scale`` (float [N, 1] per channel, or [1] per tensor); ``input_activations`` says the
activations are quantized at run time, per token, symmetric, to int8 (``dynamic: true, strategy: token``). The
forward is that of compressed-tensors' own quantized linear: each token row's codes are ``round(x / s)`` with
``s = absmax / 127.5`` (``w8a8_gemm.quantize_per_token_ref``), and the output is ``(q * s) @ (w * sw).T``.
Here the product is taken in integers (``w8a8_gemm``'s C kernel on CPU, ``torch._int_mm`` where it takes the
shapes, else exact float64 sums), then scaled: the result equals that dequantized product up to float
rounding.

Static W8A8 (``input_activations`` ``dynamic: false, strategy: tensor``, symmetric) stores one calibrated
``input_scale`` a projection: the codes are ``clamp(round(x / input_scale), -128, 127)`` as
compressed-tensors' fake quantization computes them, then the same integer product (``int_sums``, over the
plain codes). A fused projection whose parts were calibrated to different scales quantizes its input once per
part.

``parse_w8a8_scheme(group, where)`` checks one config group's quantization args and raises ValueError naming
the field; ``load_linear_w8a8(get, prefixes, strategy, bias, dtype, device)`` builds the runtime module of one
(possibly fused) projection from the checkpoint's tensors."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import w8a8_gemm

FORMAT = "int-quantized"


def _require(args: dict, where: str, field: str, allowed: tuple, default: Any = None) -> Any:
    value = args.get(field, default)
    if value not in allowed:
        shown = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{where}.{field}: {value!r} is not supported (expected {shown})")
    return value


def parse_w8a8_scheme(group: dict, where: str) -> tuple[str, bool]:
    """Check one compressed-tensors config group (``where`` names it, e.g.
    ``quantization_config.config_groups.group_0``) for W8A8 as this module runs it; returns (the weight
    strategy, 'channel' or 'tensor'; whether the activation scales are static). Raises ValueError naming the
    first field that does not fit."""
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights: {weights!r} is not supported (expected int8 weight args)")
    w = f"{where}.weights"
    _require(weights, w, "num_bits", (8,))
    _require(weights, w, "type", ("int",))
    _require(weights, w, "symmetric", (True,))
    _require(weights, w, "dynamic", (False,), False)
    strategy = _require(weights, w, "strategy", ("channel", "tensor"))
    acts = group.get("input_activations")
    if not isinstance(acts, dict):
        raise ValueError(
            f"{where}.input_activations: {acts!r} is not supported (W8A8 expects dynamic per-token int8)"
        )
    a = f"{where}.input_activations"
    _require(acts, a, "num_bits", (8,))
    _require(acts, a, "type", ("int",))
    dynamic = _require(acts, a, "dynamic", (True, False))
    _require(acts, a, "strategy", ("token",) if dynamic else ("tensor",))
    _require(acts, a, "symmetric", (True,))
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: {group['output_activations']!r} is not supported")
    return strategy, not dynamic


def int_sums(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``q @ w.T`` of int8 [M, K] and [N, K]: ``torch._int_mm`` where the device takes the shapes
    (CUDA's wants more than 16 rows: fewer are padded with zero rows), else float64 sums (exact: each is an
    integer below 2^53)."""
    m = q.shape[0]
    try:
        padded = F.pad(q, (0, 0, 0, 17 - m)) if q.is_cuda and m <= 16 else q
        return torch._int_mm(padded, w.t())[:m]
    except (RuntimeError, NotImplementedError):
        return (q.double() @ w.double().T).to(torch.int32)


class W8A8Linear(nn.Module):
    """int8 weight [N, K] with float32 scales [N]; activations quantized per token in each call.

    On CPU where ``w8a8_gemm`` builds, the weight is held in the kernel's panel layout alone (``packed``)
    and the kernel takes every batch; elsewhere the plain codes (``weight``) go through ``int_sums``.
    ``input_scales`` (static activation scales, float32 [P]) with ``part_rows`` (the P parts' row counts):
    each part's rows take the input quantized with its own scale, through ``int_sums``."""

    mode = "w8a8"

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: Optional[torch.Tensor],
        input_scales: Optional[torch.Tensor] = None,
        part_rows: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("scales", scales.float().reshape(-1).contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("input_scales", None if input_scales is None else input_scales.float())
        self.part_rows = tuple(part_rows) or (self.out_features,)
        on_cpu = weight.device.type == "cpu" and w8a8_gemm.available() and input_scales is None
        self.register_buffer("weight", None if on_cpu else weight.contiguous())
        self.register_buffer("packed", w8a8_gemm.pack(weight) if on_cpu else None)
        self.register_buffer(
            "scales_padded", w8a8_gemm.padded_scales(self.scales) if on_cpu else None, persistent=False
        )

    def codes(self) -> torch.Tensor:
        """The plain int8 [N, K] codes."""
        if self.weight is not None:
            return self.weight
        return w8a8_gemm.unpack(self.packed, self.out_features, self.in_features)

    def _static(self, x2d: torch.Tensor) -> torch.Tensor:
        """Each part's int32 sums over its input codes, scaled by its input scale, float32 [M, N]."""
        xf, outs = x2d.float(), []
        for w, s in zip(self.codes().split(self.part_rows), self.input_scales.tolist()):
            q = torch.round(torch.clamp(xf / s, -128.0, 127.0)).to(torch.int8)
            outs.append(int_sums(q, w).float() * s)
        return torch.cat(outs, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if self.input_scales is not None:
            y = self._static(x2d) * self.scales[None, :]
            y = (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        elif (
            self.packed is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        ):
            y = w8a8_gemm.w8a8_matmul(
                x2d, self.packed, self.scales_padded, self.out_features, self.bias, x.dtype
            )
        else:
            q, sx = w8a8_gemm.quantize_per_token_ref(x2d)
            y = int_sums(q, self.codes()).float() * sx[:, None] * self.scales[None, :]
            y = (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def load_linear_w8a8(
    get: Callable[[str], torch.Tensor],
    prefixes: list[str],
    strategy: str,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    static: bool = False,
) -> W8A8Linear:
    """The runtime module of the projection stored under ``prefixes`` (several for a fused projection:
    their rows concatenated; the activations are the same, so each part's per-token quantization is the
    same too). ``get(name)`` reads a checkpoint tensor (ValueError naming a missing one). ``static``: each
    part's ``input_scale`` (one value) quantizes its input; equal ones are kept once."""
    weights, scales, biases, inputs = [], [], [], []
    for p in prefixes:
        w = get(f"{p}.weight")
        if w.dtype != torch.int8:
            raise ValueError(f"model: {p}.weight is {w.dtype}, the int-quantized format stores int8")
        s = get(f"{p}.weight_scale").float().reshape(-1)
        if s.numel() not in ((1,) if strategy == "tensor" else (w.shape[0],)):
            raise ValueError(
                f"model: {p}.weight_scale has {s.numel()} values for {w.shape[0]} rows ({strategy} strategy)"
            )
        if static:
            a = get(f"{p}.input_scale").float().reshape(-1)
            if a.numel() != 1 or not bool(a[0] > 0):
                raise ValueError(
                    f"model: {p}.input_scale must be one positive value (static tensor strategy)"
                )
            inputs.append(a)
        weights.append(w)
        scales.append(s.expand(w.shape[0]))
        if bias:
            biases.append(get(f"{p}.bias"))
    b = torch.cat(biases).to(device=device, dtype=dtype) if bias else None
    rows: tuple[int, ...] = tuple(w.shape[0] for w in weights)
    a = torch.cat(inputs) if static else None
    if a is not None and bool((a == a[0]).all()):
        a, rows = a[:1], ()
    return W8A8Linear(torch.cat(weights).to(device), torch.cat(scales).to(device), b, a, rows)
