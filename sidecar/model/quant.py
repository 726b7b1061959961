"""Weight-only int8 / int4 runtime modules and the quantize-on-load hooks.

The runtime half of quantization ("swap modules for runtime"): ``Int8Linear`` /
``Int4Linear`` hold the codes of the stored format (``quant_format.py``) in
whatever layout the device's fused kernel wants (``_weight_int8pack_mm``, ``_weight_int4pack_mm[_for_cpu]``)
as buffers, and never materialise a dequantized weight. On CPU, int8 batches of up to ``int8_gemv.MAX_ROWS``
rows (decode steps; bf16 prefills too through the tile-layout kernel over the widened codes, or wherever the AVX2
path over the codes is built: ``int8_gemv.takes``) and int4 batches of up to ``int4_gemv.MAX_ROWS`` rows (any
number with AMX: ``tiles_take``) go through our own kernels (``kernels/cpu/int8_gemv.c``, ``kernels/cpu/int4_gemv.c``,
which reads torch's packed int4 layout in place, and ``kernels/cpu/amx_gemm.c``) when they build. ``quantize_linear``
/ ``quantize_tied_embedding`` are the loader's hooks for quantizing a full-precision model while it loads; saving
and reloading quantized checkpoints is ``quant_checkpoint.py``. With the model's ``FastPaths.weight_only`` on
(set through ``set_fast_paths``), decode-sized batches on CUDA go through the Triton kernels of
``kernels/triton/wo.py`` instead, which read the stored format.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import int4_gemv, int8_gemv, norm_act
from sidecar.model.kernels.gpu_paths import FastPaths, triton_available, triton_interpreted
from sidecar.model.quant_format import (
    CHUNK_ROWS,
    N_ALIGN_INT4,
    check_quant_args,
    dequantize_int4,
    padded_in_features,
    quantize_weight,
    release_freed_memory,
    unpack_int4,
)


def kernel_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Activation dtype the fused kernels run in.

    CPU kernels accept bf16/fp16/fp32, but their fp32 paths are far slower than
    fp32 F.linear, so fp32 activations are rounded to bf16 around the kernel
    (error comparable to the weight quantization itself). CUDA int4 takes bf16 only.
    """
    if device.type == "cuda":
        return torch.bfloat16
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


_INT8_FUSED_OK: dict[str, bool] = {}
# The CPU kernels use aligned vector loads: an operand whose data pointer is not 64-byte
# aligned (a view into a larger buffer, a tensor read from a memory-mapped safetensors file)
# crashes the process. Fresh allocations are 64-byte aligned, so such operands are copied.
_ALIGN_BYTES = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN_BYTES == 0 else t.clone()


# CPU layers keep no plain int4 codes (no Triton on CPU); tests of the Triton kernel under its
# interpreter set this before loading a model.
PLAIN_INT4_ON_CPU = False


def _keeps_plain_int4(device: torch.device) -> bool:
    """Whether an int4 layer keeps its nibble-packed codes beside the device kernel's layout, for the
    Triton kernel: on CUDA with Triton."""
    if device.type == "cuda":
        return triton_available()
    return device.type == "cpu" and PLAIN_INT4_ON_CPU and triton_interpreted()


class _QuantLinearBase(nn.Module, metaclass=abc.ABCMeta):
    fast_paths: Optional[FastPaths] = None  # the model's switchboard, shared by every layer
    _cpu_layer = (
        None  # our CPU kernel's view of the buffers, checked once (int8_gemv.Layer / int4_gemv.Layer)
    )

    def _checked(self, make, *operands):
        """``_cpu_layer`` for these buffers, made by ``make(*operands)`` at first use or when one was replaced."""
        if self._cpu_layer is None or not self._cpu_layer.matches(*operands):
            self._cpu_layer = make(*operands)
        return self._cpu_layer

    def __init__(self, in_features: int, out_features: int, bias: Optional[torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.k_padded = padded_in_features(in_features)
        self.register_buffer("bias", bias)

    def set_fast_paths(self, paths: Optional[FastPaths]) -> None:
        self.fast_paths = paths

    def _takes_triton(self, x2d: torch.Tensor) -> bool:
        return self.fast_paths is not None and self.fast_paths.takes("weight_only", x2d)

    @staticmethod
    def _triton_input(x2d: torch.Tensor) -> torch.Tensor:
        """On CUDA the Triton kernels take activations as torch's fused kernels there (the reference) do, in
        the kernel dtype; under the interpreter as they are."""
        kdt = kernel_dtype(x2d.dtype, x2d.device)
        return x2d.to(kdt) if x2d.is_cuda and x2d.dtype != kdt else x2d

    @abc.abstractmethod
    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        """[M, k_padded] activations in the layer's dtype -> [M, >= out_features] outputs."""

    @staticmethod
    def _fused_input(x2d: torch.Tensor) -> torch.Tensor:
        """Activations as torch's fused kernels take them: in the kernel dtype, 64-byte aligned."""
        kdt = kernel_dtype(x2d.dtype, x2d.device)
        return _aligned(x2d if x2d.dtype == kdt else x2d.to(kdt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if self.k_padded != self.in_features:
            x2d = F.pad(x2d, (0, self.k_padded - self.in_features))
        y = self._matmul(x2d)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Linear(_QuantLinearBase):
    """Buffers: weight int8 [N, Kp] (zero-padded columns), scales [N] in the kernel dtype."""

    mode = "int8"

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        bias: Optional[torch.Tensor],
        dtype: torch.dtype,
    ):
        super().__init__(in_features, qweight.shape[0], bias)
        kp = self.k_padded
        w = qweight if qweight.shape[1] == kp else F.pad(qweight, (0, kp - qweight.shape[1]))
        self.register_buffer("weight", _aligned(w))
        self.register_buffer("scales", _aligned(scales.to(kernel_dtype(dtype, qweight.device))))
        # Full-precision scales for our CPU decode kernel (which takes float32 activations).
        self.register_buffer("scales_f32", scales.float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if (
            x2d.device.type == "cpu"
            and int8_gemv.takes(x2d.shape[0], x.dtype)
            and (x.dtype is torch.float32 or x.dtype is torch.bfloat16)
            and not self._takes_triton(x2d)
            and self.weight.device.type == "cpu"
            and int8_gemv.available()
        ):
            # Our kernels (a decode-sized batch, or a prefill's over the codes where the AVX2 path is
            # built) read the activations as they are (zero-padded to the codes' width) and add the bias
            # themselves.
            if self.k_padded != self.in_features:
                x2d = F.pad(x2d, (0, self.k_padded - self.in_features))
            layer = self._checked(int8_gemv.Layer, self.weight, self.scales_f32, self.bias)
            return layer(x2d, x.dtype).reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self._takes_triton(x2d):
            from sidecar.model.kernels.triton import wo as triton_wo

            y = triton_wo.int8_matmul(self._triton_input(x2d), self.weight, self.scales_f32)
            if y is not None:  # None: more rows than a decode step, the fused path below
                return y
        if x2d.device.type == "cpu" and x2d.shape[0] <= int8_gemv.MAX_ROWS and int8_gemv.available():
            return int8_gemv.int8_matmul(x2d, self.weight, self.scales_f32)  # decode-sized batch: our kernel
        x2d = self._fused_input(x2d)
        scales = self.scales if self.scales.dtype == x2d.dtype else self.scales.to(x2d.dtype)
        dev = x2d.device.type
        if _INT8_FUSED_OK.get(dev, True):
            try:
                return torch.ops.aten._weight_int8pack_mm(x2d, self.weight, scales)
            except (RuntimeError, NotImplementedError):
                if dev == "cpu":
                    raise
                _INT8_FUSED_OK[dev] = False  # no fused kernel on this device: use the cast path
        # The weight is cast to the activation dtype one layer at a time; never stored.
        return F.linear(x2d, self.weight.to(x2d.dtype)) * scales


class Int4Linear(_QuantLinearBase):
    """Buffers: weight = int4 codes packed for the device's kernel, scales_and_zeros [G, Np, 2]."""

    mode = "int4"

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        in_features: int,
        bias: Optional[torch.Tensor],
        dtype: torch.dtype,
    ):
        super().__init__(in_features, qweight.shape[0], bias)
        n, groups = scales.shape
        self.group_size = self.k_padded // groups
        device = qweight.device
        n_pad = -(-n // N_ALIGN_INT4) * N_ALIGN_INT4 - n
        # Padded rows get scale 0 and zero 0, so they produce 0 and are sliced off anyway.
        sz = torch.stack((scales, zeros), dim=-1)
        sz = F.pad(sz, (0, 0, 0, 0, 0, n_pad)).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", _aligned(sz.to(kernel_dtype(dtype, device))))
        if n_pad:
            qweight = F.pad(qweight, (0, 0, 0, n_pad))
        # The stored nibbles as they are, for the Triton kernel (which reads scales_and_zeros too).
        # The price: a second copy of the codes, as large as the packed weight.
        plain = qweight.contiguous() if _keeps_plain_int4(device) else None
        self.register_buffer("qweight_plain", plain, persistent=False)
        if device.type == "cpu":
            # Packed chunk by chunk into one preallocated buffer: the int32 codes the op takes
            # are 8x the packed size, too much scratch for a vocab-sized lm_head at once.
            weight = torch.empty(qweight.shape, dtype=torch.uint8)
            for r in range(0, qweight.shape[0], CHUNK_ROWS):
                codes = unpack_int4(qweight[r : r + CHUNK_ROWS]).to(torch.int32)
                weight[r : r + codes.shape[0]] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        else:
            # The CUDA kernel wants the even column in the high nibble.
            swapped = (qweight << 4) | (qweight >> 4)
            inner_k_tiles = 8 if self.k_padded % 128 == 0 else (4 if self.k_padded % 64 == 0 else 2)
            weight = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
        self.register_buffer("weight", _aligned(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d, sz = x.reshape(-1, self.in_features), self.scales_and_zeros
        # Our kernel on operands checked once (with plain codes kept for Triton, _matmul decides instead).
        rows_ok = x2d.shape[0] <= int4_gemv.MAX_ROWS or int4_gemv.tiles_take(
            self.group_size, self.k_padded, x.dtype
        )
        if (
            rows_ok
            and x2d.device.type == "cpu"
            and self.k_padded == self.in_features
            and (x.dtype is torch.bfloat16 or x.dtype is torch.float32)
            and self.qweight_plain is None
            and sz.dtype == torch.bfloat16
            and self.weight.device.type == "cpu"
            and int4_gemv.available()
        ):
            y = self._checked(lambda w, s: int4_gemv.Layer(w, self.group_size, s), self.weight, sz)(
                x2d, x.dtype
            )
            y = (
                y if y.shape[1] == self.out_features else y[:, : self.out_features]
            )  # bf16 in: bf16 out, one rounding
            y = (
                y if self.bias is None else norm_act.add_bias(y, self.bias)
            )  # a kernel: replays run no torch op
            return y.reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        sz = self.scales_and_zeros
        if self.qweight_plain is not None and self._takes_triton(x2d):
            from sidecar.model.kernels.triton import wo as triton_wo

            y = triton_wo.int4_matmul(self._triton_input(x2d), self.qweight_plain, sz, self.group_size)
            if y is not None:  # None: more rows than a decode step, the fused path below
                return y
        if (
            x2d.device.type == "cpu"
            and x2d.shape[0] <= int4_gemv.MAX_ROWS
            and sz.dtype == torch.bfloat16
            and int4_gemv.available()
        ):  # our kernel: bf16 layers get bf16 out, others float32
            out = torch.bfloat16 if x2d.dtype == torch.bfloat16 else torch.float32
            return int4_gemv.int4_matmul(x2d, self.weight, self.group_size, sz, out_dtype=out)
        x2d = self._fused_input(x2d)
        sz = sz if sz.dtype == x2d.dtype else sz.to(x2d.dtype)
        if x2d.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.weight, self.group_size, sz)
        return torch.ops.aten._weight_int4pack_mm(x2d, self.weight, self.group_size, sz)


def runtime_linear(
    stored: dict[str, torch.Tensor],
    mode: str,
    in_features: int,
    bias: Optional[torch.Tensor],
    dtype: torch.dtype,
) -> nn.Module:
    """Runtime module from stored tensors (already on the target device)."""
    if mode == "int8":
        return Int8Linear(stored["qweight"], stored["scales"], in_features, bias, dtype)
    return Int4Linear(stored["qweight"], stored["scales"], stored["zeros"], in_features, bias, dtype)


def quantize_linear(
    linear: nn.Linear, mode: str, group_size: int = 128, name: str = "", rows: Any = None
) -> nn.Module:
    """Loader hook: the runtime module replacing ``linear``.

    Frees ``linear``'s full-precision weight (the parameter is dropped from the
    module), so quantizing layer by layer keeps at most one layer in full precision.
    ``rows``: the weight read in row blocks (``file_rows.FileRows``) in place of ``linear.weight``.
    """
    check_quant_args(mode, group_size)
    w = linear.weight.detach() if rows is None else rows
    bias = None if linear.bias is None else linear.bias.detach().clone()
    stored = quantize_weight(w, mode, group_size, w.dtype, name)
    module = runtime_linear(stored, mode, linear.in_features, bias, w.dtype)
    del stored, w
    linear.weight = None  # drop our reference; memory is freed once the caller drops its own
    linear.bias = None
    release_freed_memory()
    return module


class QuantEmbedding(nn.Module):
    """Embedding lookup over quantized rows (used when lm_head is tied to the embedding).

    int8 shares the tied ``Int8Linear``'s codes, so the table is stored once.
    int4 keeps the plain nibble-packed rows: the kernel's packed layout is device
    specific and cannot be gathered by row.
    """

    def __init__(
        self,
        mode: str,
        embedding_dim: int,
        dtype: torch.dtype,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.mode, self.embedding_dim, self.dtype = mode, embedding_dim, dtype
        self.num_embeddings = qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.mode == "int8":
            rows = self.qweight[flat, : self.embedding_dim].to(self.dtype)
            out = rows * self.scales[flat].to(self.dtype)[:, None]
        else:
            out = dequantize_int4(
                self.qweight[flat], self.scales[flat], self.zeros[flat], self.embedding_dim
            ).to(self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)


def tied_modules(
    stored: dict[str, torch.Tensor], mode: str, embedding_dim: int, dtype: torch.dtype
) -> tuple[QuantEmbedding, nn.Module]:
    """(embedding, lm_head) runtime modules sharing one quantized table."""
    lm_head = runtime_linear(stored, mode, embedding_dim, None, dtype)
    if mode == "int8":
        # Shares the codes; keeps its own scales in the model dtype (the kernel's may be bf16).
        emb = QuantEmbedding(mode, embedding_dim, dtype, lm_head.weight, stored["scales"].to(dtype))
    else:
        emb = QuantEmbedding(mode, embedding_dim, dtype, stored["qweight"], stored["scales"], stored["zeros"])
    return emb, lm_head


def quantize_tied_embedding(
    embedding: nn.Embedding, mode: str, group_size: int = 128, rows: Any = None
) -> tuple[QuantEmbedding, nn.Module]:
    """Loader hook for a tied lm_head: quantize the shared table once (read from ``rows``, a
    ``file_rows.FileRows``, when given, else from ``embedding.weight``).

    Returns (embedding, lm_head) replacements and drops ``embedding``'s weight.
    """
    check_quant_args(mode, group_size)
    w = embedding.weight.detach() if rows is None else rows
    stored = quantize_weight(w, mode, group_size, w.dtype, "lm_head")
    modules = tied_modules(stored, mode, w.shape[1], w.dtype)
    embedding.weight = None
    del stored, w
    release_freed_memory()
    return modules
