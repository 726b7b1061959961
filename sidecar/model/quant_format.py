"""The stored format of weight-only int8 / int4 weights: quantize, pack, unpack.

This is the device-independent half of quantization ("make the quantized state
dict"): ``quantize_int8`` / ``quantize_int4`` turn one weight into integer codes
plus scales (and zeros), which is what a quantized checkpoint stores. The
runtime modules that run these codes through fused kernels live in ``quant.py``;
whole-model save/load lives in ``quant_checkpoint.py``.

Formats (``FORMAT_VERSION``):
- int8: symmetric per output channel. ``qweight`` int8 [N, K], ``scales`` [N];
  ``w ~= qweight * scales[:, None]`` (codes in [-127, 127]).
- int4: asymmetric, groups of ``group_size`` along K (K zero-padded to a multiple
  of ``K_ALIGN`` first). ``qweight`` uint8 [N, Kp / 2] (low nibble = even
  column), ``scales`` and ``zeros`` [N, Kp / group_size];
  ``w ~= (code - 8) * scale + zero`` -- the convention of torch's int4 kernels,
  so the stored values feed them without re-rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
FORMAT_VERSION = 1
# in_features is padded to a multiple of this: the CPU int8 kernel returns garbage (or
# crashes) for bf16 inputs when K % 16 != 0, and the int4 kernels tile K by 32.
K_ALIGN = 32
# out_features is padded to a multiple of this for int4 (CPU kernel needs N % 16, CUDA N % 8).
N_ALIGN_INT4 = 16
# Rows processed at once while quantizing/packing: bounds the fp32/int32 temporaries
# (lm_head of a 150k vocab would otherwise need ~0.5 GB of scratch). Multiple of 64 so
# the CPU int4 packed layout of chunks concatenates exactly.
CHUNK_ROWS = 4096


def check_quant_args(mode: Optional[str], group_size: int) -> None:
    """Raise ValueError naming the field for an unknown mode or group size."""
    if mode not in MODES:
        raise ValueError(f"quantization: must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"quant_group_size: must be one of {GROUP_SIZES}, got {group_size!r}")


def padded_in_features(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def _int4_groups(k: int, group_size: int, name: str = "") -> int:
    kp = padded_in_features(k)
    if kp % group_size:
        where = f" of {name}" if name else ""
        ok = [g for g in GROUP_SIZES if kp % g == 0]
        raise ValueError(
            f"quant_group_size: {group_size} does not divide in_features {k}{where} "
            f"(padded to {kp}); use one of {ok}"
        )
    return kp // group_size


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight int8 [N, K], scales [N] in scale_dtype)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=scale_dtype, device=w.device)
    for r in range(0, w.shape[0], CHUNK_ROWS):
        wc = w[r : r + CHUNK_ROWS].to(torch.float32, copy=True)  # modified in place below
        # Codes are computed from the stored (rounded) scale so dequantization is exact to it.
        s = (wc.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(scale_dtype)
        scales[r : r + CHUNK_ROWS] = s
        # In place on the one fp32 temporary: quantizing dominates quantize-on-load time.
        q[r : r + CHUNK_ROWS] = wc.div_(s.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


def quantize_int4(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype, name: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight uint8 [N, Kp/2], scales [N, G], zeros [N, G])."""
    n, k = w.shape
    groups = _int4_groups(k, group_size, name)
    kp = groups * group_size
    qweight = torch.empty(n, kp // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, groups, dtype=scale_dtype, device=w.device)
    zeros = torch.empty(n, groups, dtype=scale_dtype, device=w.device)
    for r in range(0, n, CHUNK_ROWS):
        wc = w[r : r + CHUNK_ROWS].to(torch.float32, copy=True)  # modified in place below
        wc = (F.pad(wc, (0, kp - k)) if kp != k else wc).reshape(-1, groups, group_size)
        lo, hi = torch.aminmax(wc, dim=-1)
        s = ((hi - lo) / 15.0).clamp(min=1e-8).to(scale_dtype)
        z = (lo + 8.0 * s.float()).to(scale_dtype)
        scales[r : r + CHUNK_ROWS], zeros[r : r + CHUNK_ROWS] = s, z
        codes = wc.sub_(z.float()[..., None]).div_(s.float()[..., None]).add_(8.0).round_().clamp_(0, 15)
        codes = codes.to(torch.uint8).reshape(wc.shape[0], kp)
        qweight[r : r + CHUNK_ROWS] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return qweight, scales, zeros


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp/2] -> codes uint8 [N, Kp]."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int
) -> torch.Tensor:
    codes = unpack_int4(qweight).float()
    n, groups = scales.shape
    w = (codes.reshape(n, groups, -1) - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(n, -1)[:, :in_features]


def quantize_weight(
    w: torch.Tensor, mode: str, group_size: int, scale_dtype: torch.dtype, name: str = ""
) -> dict[str, torch.Tensor]:
    """The stored tensors for one weight (keys: qweight, scales[, zeros])."""
    check_quant_args(mode, group_size)
    if mode == "int8":
        q, s = quantize_int8(w, scale_dtype)
        return {"qweight": q, "scales": s}
    q, s, z = quantize_int4(w, group_size, scale_dtype, name)
    return {"qweight": q, "scales": s, "zeros": z}


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed blocks of the layer-by-layer
    scratch otherwise, and peak RSS while quantizing on load grows with it). No-op elsewhere."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
