"""Weight-only int4 matmul on CPU (``int4_gemv.c``), for decode steps and prefill chunks, and its reference.

``int4_matmul(x, weight, group_size, scales_and_zeros)`` takes the operands of torch's
``_weight_int4pack_mm_for_cpu`` as they are (``weight`` packed by
``_convert_weight_to_int4pack_for_cpu``, bf16 ``scales_and_zeros`` [G, N, 2]) and computes
``x @ w.T`` with ``w[n, k] = (code - 8) * scale + zero`` for float32 or bf16 ``x`` [M, K],
returning float32 (or bf16) [M, N]. Where torch's kernel rounds activations to bf16 (8 bits), ours
keeps 16 bits (``integer_dot()``: AVX-512 VNNI, or AVX2 alone; one scale per row and group) or all of
float32 (AVX-512 without VNNI and VBMI). ``reference`` is the same product from the plain codes in float64,
the oracle for tests.

torch's packed layout depends on the CPU capability torch runs with (blocks of 64 rows with
AVX-512, 32 with AVX2, nibble pairs otherwise; see the C source). ``pack`` writes each of these
layouts; the kernel is only used once ``pack`` has been found to match torch's own packing here.
"""
from __future__ import annotations

from typing import Optional

import torch

from sidecar.model.kernels import cpu_build
from sidecar.model.kernels.cpu_build import I, P

# Rows (sequences in a decode step, tokens in a prefill chunk) up to which this kernel is used.
# Measured on Zen 5 (AVX-512 VNNI), Qwen2-0.5B-shaped layers: 1.6-3x faster than torch's packed kernel
# from 1 to 32 rows on one or two threads, and still ~2x at 2048 rows (the default token budget of a
# step); beyond that torch's kernel. The AVX2 build's float path, against torch's AVX2 kernel: 2.4x at 1 row,
# even from 4 to 32; its integer path (Zen 3, 4,864 x 896): 1.5x the float path at 1 row, 1.2x at 256.
MAX_ROWS = 2048
# The integer path rounds each activation to round(x * ACTIVATION_CODE_MAX / absmax of its group):
# 16-bit codes whose high and low bytes are both int8.
ACTIVATION_CODE_MAX = 32639
LAYOUTS = ((64, True), (32, True), (32, False), (64, False))  # (rows per block, split nibbles)
_layout: list[Optional[tuple[int, bool]]] = []


_KERNEL = cpu_build.Kernel("int4_gemv", {
    "sidecar_int4_matmul": ([P] * 4 + [I] * 9, I),
    "sidecar_int4_vector_bits": ([], I),
    "sidecar_int4_integer_dot": ([], I),
})


def pack(codes: torch.Tensor, block_n: int, split: bool) -> torch.Tensor:
    """Codes [N, K] (0..15, N % 16 == 0, K even) -> uint8 [N, K / 2] in one of torch's CPU layouts."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    full = n // block_n * block_n
    parts = []
    if full:
        b = c[:full].reshape(-1, block_n, k).transpose(1, 2)  # [blocks, K, block_n]
        if split:
            lo, hi = b[..., :block_n // 2], b[..., block_n // 2:]
        else:
            lo, hi = b[..., 0::2], b[..., 1::2]
        parts.append((lo | (hi << 4)).reshape(-1))
    if full < n:  # the last rows: one block of nibble pairs
        t = c[full:].T
        parts.append((t[:, 0::2] | (t[:, 1::2] << 4)).reshape(-1))
    return torch.cat(parts).reshape(n, k // 2)


def torch_layout() -> Optional[tuple[int, bool]]:
    """(block_n, split) of ``_convert_weight_to_int4pack_for_cpu`` in this process, None if unknown."""
    if not _layout:
        n, k = 112, 64  # a tail block in every layout
        codes = ((torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 3 + torch.arange(n)[:, None] // 5) % 16)
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        except (RuntimeError, AttributeError):
            packed = None
        found = [lay for lay in LAYOUTS if packed is not None and torch.equal(pack(codes, *lay), packed.reshape(n, -1))]
        _layout.append(found[0] if found else None)
    return _layout[0]


def available() -> bool:
    return _KERNEL.lib() is not None and torch_layout() is not None


def vector_bits() -> int:
    """The vector width the built kernel uses (512 with AVX-512, else 256); 0 when not built."""
    lib = _KERNEL.lib()
    return 0 if lib is None else lib.sidecar_int4_vector_bits()


def integer_dot() -> bool:
    """Whether the built kernel rounds activations to 16-bit integers (``ACTIVATION_CODE_MAX``, one
    scale per row and group) for its integer dot products (AVX-512 VNNI), else they stay float32."""
    lib = _KERNEL.lib()
    return lib is not None and bool(lib.sidecar_int4_integer_dot())


def int4_matmul(x: torch.Tensor, weight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                layout: Optional[tuple[int, bool]] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Requires ``available()``. All on the CPU; ``x`` [M, K] (any M, float32 or bf16 read as they are, other
    dtypes converted), ``weight`` packed uint8 [N, K / 2] (N % 16 == 0) in ``layout`` (default: torch's),
    ``scales_and_zeros`` bf16 [K / group_size, N, 2], group_size a multiple of 16 up to 256. Returns
    ``out_dtype`` [M, N]: float32, or bf16 (the float32 result rounded as ``Tensor.to`` does)."""
    lib = _KERNEL.lib()
    layout = layout or torch_layout()
    assert lib is not None and layout is not None, "int4_gemv kernel is not available"
    m, k = x.shape
    n = weight.shape[0]
    if (weight.shape != (n, k // 2) or weight.dtype != torch.uint8 or n % 16 or k % 2
            or group_size not in range(16, 257, 16) or k % group_size
            or scales_and_zeros.shape != (k // group_size, n, 2) or scales_and_zeros.dtype != torch.bfloat16
            or out_dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"int4_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"group_size {group_size}, scales_and_zeros {tuple(scales_and_zeros.shape)} "
                         f"{scales_and_zeros.dtype}, out_dtype {out_dtype} do not fit")
    x = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    weight, sz = weight.contiguous(), scales_and_zeros.contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    rc = lib.sidecar_int4_matmul(x.data_ptr(), weight.data_ptr(), sz.data_ptr(), y.data_ptr(), m, n, k, group_size,
                                 layout[0], int(layout[1]), int(x.dtype == torch.bfloat16),
                                 int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc == -2:
        raise MemoryError("int4_matmul: no memory for the activation scratch")
    assert rc == 0, "int4_gemv refused arguments checked above"
    return y


class Layer(cpu_build.LayerView):
    """One layer's static operands (``weight``, ``group_size``, ``scales_and_zeros`` as ``int4_matmul`` takes
    them, torch's layout) checked once, so that a call checks only the activations: in a decode step the
    checks and conversions around the product cost more than the product itself for most layers (~45 of
    ~105 us for a 896 x 896 layer on Zen 3; 97 layers a token). ``matches`` says whether it still holds these
    tensors (the module's buffers may be replaced)."""

    __slots__ = ("weight", "sz", "n", "k", "fn")

    def __init__(self, weight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> None:
        lib = _KERNEL.lib()
        layout = torch_layout()
        if lib is None or layout is None:
            raise RuntimeError("int4_gemv kernel is not available")
        n, half = weight.shape
        k = 2 * half
        int4_matmul(torch.zeros(1, k), weight, group_size, scales_and_zeros)  # the checks, once
        if not weight.is_contiguous() or not scales_and_zeros.is_contiguous():
            raise ValueError("int4 layer: weight and scales_and_zeros must be contiguous")
        self.weight, self.sz = weight, scales_and_zeros
        self.n, self.k = n, k
        self.fn = (lib.sidecar_int4_matmul, group_size, layout[0], int(layout[1]))

    def matches(self, weight: torch.Tensor, scales_and_zeros: torch.Tensor) -> bool:
        return weight is self.weight and scales_and_zeros is self.sz

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``int4_matmul(x, ...)`` for float32 or bf16 ``x`` [M, K] on the CPU; ``out_dtype`` float32 or bf16."""
        if x.dtype is not torch.bfloat16 and x.dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        m, k = x.shape
        if k != self.k:
            raise ValueError(f"int4 layer: x {tuple(x.shape)} for a layer of {self.k} inputs")
        y = torch.empty(m, self.n, dtype=out_dtype)
        fn, gs, block_n, split = self.fn
        rc = fn(x.data_ptr(), self.weight.data_ptr(), self.sz.data_ptr(), y.data_ptr(), m, self.n, k, gs, block_n,
                split, x.dtype is torch.bfloat16, out_dtype is torch.bfloat16, torch.get_num_threads())
        if rc == -2:
            raise MemoryError("int4_matmul: no memory for the activation scratch")
        assert rc == 0, "int4_gemv refused arguments checked at construction"
        return y


def reference(x: torch.Tensor, codes: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K], plain codes [N, K] (0..15), scales_and_zeros [G, N, 2] -> float32 [M, N] via float64."""
    sz = scales_and_zeros.double()
    s = sz[..., 0].T.repeat_interleave(group_size, dim=1)
    z = sz[..., 1].T.repeat_interleave(group_size, dim=1)
    return (x.double() @ ((codes.double() - 8.0) * s + z).T).float()
