"""The stored formats of hub-quantized linears, read into one neutral form and converted to ours.

Every reader returns a ``Source``: unsigned codes ``u`` [N, K], per-group ``scales`` and unsigned zero codes
``zeros`` [N, G], and the group of each input column ``g_idx`` [K] (None: contiguous groups of K / G), so that
the tool's dequantized weight is ``w[n, k] = (u[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]]``.

- GPTQ (AutoGPTQ / GPTQModel, transformers' GPTQ integration): ``qweight`` int32 [K * bits / 32, N], input
  rows packed low bits first along K; ``qzeros`` int32 [G, N * bits / 32] packed the same way along N and,
  in the v1 format (``checkpoint_format: gptq``), stored minus one (subtracted from the whole word);
  ``scales`` [G, N]; ``g_idx`` int32 [K] (with ``desc_act`` the groups are in activation order, not
  contiguous).
- AWQ GEMM (AutoAWQ): ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], eight output columns per
  word whose nibble ``i`` holds column ``AWQ_ORDER[i]``; zeros stored as they are; ``scales`` [G, N].
- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [N, ceil(K * bits / 32)] packed along K
  (``pack_to_int32``: the signed code plus ``2 ** (bits - 1)``), ``weight_scale`` [N, G] (G = 1 for the
  channel strategy), ``weight_zero_point`` (asymmetric only) int32 packed along N, ``weight_g_idx`` with
  group act-order.

``int4_operands`` turns a Source into our int4 format (``quant_format.py``: ``w = (u - 8) * s + zero``,
so ``zero = (8 - z) * s``, exact in float32 for fp16/bf16 scales); ``int8_operands`` into int8 codes
``u - z`` (within [-128, 127]) with one scale per output channel. Both refuse what the kernels cannot hold
exactly, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from sidecar.model.quant_format import padded_in_features

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word sits in nibble AWQ_REVERSE_ORDER[j]
# Group sizes torch's int4 kernels (and ours) take; a stored group size that is a multiple of one of them is
# held exactly by repeating its scale and zero.
KERNEL_GROUPS = (256, 128, 64, 32)


@dataclass
class Source:
    codes: torch.Tensor  # uint8 [N, K], unsigned
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor  # float32 [N, G], unsigned zero codes
    g_idx: Optional[torch.Tensor]  # int64 [K] or None
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The tool's dequantized weight, float32 [N, K]."""
        g = self.group_index()
        return (self.codes.float() - self.zeros[:, g]) * self.scales[:, g]

    def group_index(self) -> torch.Tensor:
        k, groups = self.codes.shape[1], self.scales.shape[1]
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(k) // -(-k // groups)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """32-bit words (int32, or their unsigned values in int64) -> unsigned codes (uint8), ``32 / bits``
    values per word, lowest bits first, along ``dim``. One field at a time, so the scratch is one tensor
    of the words' size, never the codes widened to the words' width."""
    per, mask = 32 // bits, (1 << bits) - 1
    shape = list(words.shape)
    shape[dim] *= per
    out = torch.empty(shape, dtype=torch.uint8)
    for j in range(per):
        # an arithmetic shift of a negative int32 fills the high bits only; the mask drops them
        field = ((words >> (bits * j)) & mask).to(torch.uint8)
        if dim == 0:
            out[j::per] = field
        else:
            out[:, j::per] = field
    return out


def gptq_source(get, has, name: str, bits: int, zero_offset: int, in_features: int) -> Source:
    codes = unpack_words(get(f"{name}.qweight"), bits, 0)[:in_features].T
    words = get(f"{name}.qzeros").to(torch.int64)
    if zero_offset:
        # v1 -> v2 as GPTQModel converts: one added to every field of the word at once, carries included
        # (the inverse of its v2 -> v1 subtraction, whose borrows a zero point of 0 needs).
        words = (words + sum(1 << s for s in range(0, 32, bits))) & 0xFFFFFFFF
    zeros = unpack_words(words, bits, 1)[:, : codes.shape[0]]
    g_idx = get(f"{name}.g_idx").long() if has(f"{name}.g_idx") else None
    return Source(codes.to(torch.uint8), get(f"{name}.scales").float().T, zeros.float().T, g_idx, bits)


def awq_source(get, name: str) -> Source:
    def unpack(words: torch.Tensor) -> torch.Tensor:
        vals = unpack_words(words, 4, 1)
        return vals.reshape(vals.shape[0], -1, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(vals.shape)

    codes = unpack(get(f"{name}.qweight")).T
    zeros = unpack(get(f"{name}.qzeros")).T.float()
    return Source(codes.to(torch.uint8), get(f"{name}.scales").float().T, zeros, None, 4)


def compressed_source(get, has, name: str, bits: int, symmetric: bool) -> Source:
    n, k = (int(x) for x in get(f"{name}.weight_shape").tolist())
    codes = unpack_words(get(f"{name}.weight_packed"), bits, 1)[:, :k]
    scales = get(f"{name}.weight_scale").float()
    if symmetric:
        zeros = torch.full(scales.shape, float(1 << (bits - 1)))
    else:
        zp = get(f"{name}.weight_zero_point")
        # packed int32 along N (pack_to_int32, as the compressor writes it), or the signed codes as they are
        packed = zp.dtype == torch.int32
        zeros = (unpack_words(zp, bits, 0)[:n] if packed else zp.to(torch.int64) + (1 << (bits - 1))).float()
    g_idx = get(f"{name}.weight_g_idx").long() if has(f"{name}.weight_g_idx") else None
    return Source(codes.to(torch.uint8), scales, zeros, g_idx, bits)


def _contiguous(src: Source, name: str) -> tuple[Source, Optional[torch.Tensor]]:
    """The Source with its input columns permuted so that groups are contiguous and of equal size, and the
    permutation (None when already so): the layer then computes ``x[..., perm] @ w[:, perm].T``."""
    k, groups = src.codes.shape[1], src.scales.shape[1]
    if k % groups:
        raise ValueError(f"{name}: {groups} scale groups do not divide in_features {k}")
    g, perm = src.group_index(), None
    if bool((g[1:] < g[:-1]).any()):
        perm = torch.argsort(g, stable=True)
        g = g[perm]
        src = Source(src.codes[:, perm], src.scales, src.zeros, None, src.bits)
    if not torch.equal(g, torch.arange(k) // (k // groups)):
        raise ValueError(f"{name}.g_idx: groups are not {groups} runs of {k // groups} input columns")
    return src, perm


def int4_operands(
    src: Source, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(qweight uint8 [N, Kp / 2], scales, zeros float32 [N, Kp / group], perm) in our int4 format; the kernel
    group is the largest of ``KERNEL_GROUPS`` dividing the stored one (per-channel: dividing Kp)."""
    src, perm = _contiguous(src, name)
    n, k = src.codes.shape
    kp = padded_in_features(k)
    span = kp if src.scales.shape[1] == 1 else k // src.scales.shape[1]
    group = next((g for g in KERNEL_GROUPS if span % g == 0), None)
    if group is None:
        raise ValueError(
            f"quantization_config.group_size: {span} is not supported (a multiple of 32, or -1) for {name}"
        )
    rep = span // group
    scales = src.scales.repeat_interleave(rep, dim=1)
    zeros = ((8.0 - src.zeros) * src.scales).repeat_interleave(rep, dim=1)
    codes = F.pad(src.codes, (0, kp - k), value=8) if kp != k else src.codes
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales, zeros, perm


def int8_operands(
    src: Source, name: str
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(codes int8 [N, K], scales float32 [N], perm, offsets float32 [N] or None): 8-bit weights with one
    scale per output channel as int8 codes ``u - c`` and a per-row ``offset = (c - z) * s``, so that
    ``w[n, k] = code[n, k] * s[n] + offset[n]`` and the layer adds ``offset * sum(x)`` to the int8 product.
    ``c`` is the zero point ``z`` where the row's codes minus it lie within int8's [-128, 127] (every
    symmetric file: zero 128, code 0 being -128, which every int8 kernel path takes), else the nearest shift
    that fits (an asymmetric zero point); offsets is None when no row needs one."""
    if src.scales.shape[1] != 1:
        raise ValueError(
            f"quantization_config.bits: 8 with grouped scales is not supported for {name} "
            "(the int8 kernels hold one scale per output channel)"
        )
    src, perm = _contiguous(src, name)
    u, z = src.codes.to(torch.int16), src.zeros[:, 0].round().to(torch.int16)
    lo, hi = u.amin(1) + 128, u.amax(1) - 127  # the shifts c with u - c within [-128, 127]
    if bool((hi > lo).any()):
        raise ValueError(f"{name}: codes span more than 8 bits")
    shift = torch.minimum(torch.maximum(z, hi), lo)
    codes = (u - shift[:, None]).to(torch.int8)
    scales = src.scales[:, 0]
    offsets = None
    if not torch.equal(shift, z):
        offsets = (shift - z).float() * scales
    return codes, scales, perm, offsets
