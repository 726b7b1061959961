"""Weight-only int4 matmul on CPU (``int4_gemv.c``), for decode steps and prefill chunks, and its reference.

``int4_matmul(x, weight, group_size, scales_and_zeros)`` takes the operands of torch's
``_weight_int4pack_mm_for_cpu`` as they are (``weight`` packed by
``_convert_weight_to_int4pack_for_cpu``, bf16 ``scales_and_zeros`` [G, N, 2]) and computes
``x @ w.T`` with ``w[n, k] = (code - 8) * scale + zero`` for float32 or bf16 ``x`` [M, K],
returning float32 (or bf16) [M, N]. Where torch's kernel rounds activations to bf16 (8 bits), ours
keeps 16 bits (``integer_dot()``: AVX-512 VNNI, or AVX2 alone; one scale per row and group) or all of
float32 (AVX-512 without VNNI and VBMI). ``reference`` is the same product from the plain codes in float64,
the oracle for tests.

On a CPU with AMX, bf16 batches of ``TILE_MIN_ROWS`` rows or more go instead through tile products over the codes
widened to bf16 (``amx_gemm.c``: exact products, float32 sums a quantization group, then its scale and zero), once
``tiles_available()`` has checked them against ``reference``.

torch's packed layout depends on the CPU capability torch runs with (blocks of 64 rows with
AVX-512, 32 with AVX2, nibble pairs otherwise; see the C source). ``pack`` writes each of these
layouts; the kernel is only used once ``pack`` has been found to match torch's own packing here.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from sidecar.model.kernels.cpu import amx_gemm, cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import MatmulArgs
from sidecar.model.kernels.cpu.moe_args import MoeArgs

log = logging.getLogger("sidecar.kernels")

# Rows (sequences in a decode step, tokens in a prefill chunk) up to which this kernel is used (the default token
# budget of a step; it stays ahead of torch's packed kernel there); beyond that torch's kernel.
MAX_ROWS = 2048
# The integer path rounds each activation to round(x * ACTIVATION_CODE_MAX / absmax of its group):
# 16-bit codes whose high and low bytes are both int8.
ACTIVATION_CODE_MAX = 32639
LAYOUTS = ((64, True), (32, True), (32, False), (64, False))  # (rows per block, split nibbles)
_layout: list[Optional[tuple[int, bool]]] = []
# From this many rows, bf16 activations go through the AMX tile path over the codes where it runs: where the tile
# products overtake this kernel's per-row ones, with the weights coming from memory as in a decode step.
TILE_MIN_ROWS = 8
_tiles: dict[str, str] = {}  # "reason": why the tile path is off ('' when on), once checked


_KERNEL = cpu_build.Kernel(
    "int4_gemv",
    {
        "sidecar_int4_matmul": ([MatmulArgs], I),
        "sidecar_int4_moe": ([MoeArgs], I),
        "sidecar_int4_vector_bits": ([], I),
        "sidecar_int4_integer_dot": ([], I),
        "sidecar_int4_moe_grouped": ([MoeArgs], I),
        "sidecar_int4_moe_grouped_row_bytes": ([MoeArgs], ctypes.c_int64),
    },
)


def pack(codes: torch.Tensor, block_n: int, split: bool) -> torch.Tensor:
    """Codes [N, K] (0..15, N % 16 == 0, K even) -> uint8 [N, K / 2] in one of torch's CPU layouts."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    full = n // block_n * block_n
    parts = []
    if full:
        b = c[:full].reshape(-1, block_n, k).transpose(1, 2)  # [blocks, K, block_n]
        if split:
            lo, hi = b[..., : block_n // 2], b[..., block_n // 2 :]
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
        codes = (
            torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 3 + torch.arange(n)[:, None] // 5
        ) % 16
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        except (RuntimeError, AttributeError):
            packed = None
        found = [
            lay
            for lay in LAYOUTS
            if packed is not None and torch.equal(pack(codes, *lay), packed.reshape(n, -1))
        ]
        _layout.append(found[0] if found else None)
    return _layout[0]


def available() -> bool:
    return _KERNEL.lib() is not None and torch_layout() is not None


def tiles_available() -> bool:
    """Whether bf16 batches of ``TILE_MIN_ROWS`` rows or more take the AMX tile path (``tile_matmul``): AMX here,
    both kernels built, torch's layout known, and a self-check against ``reference`` passed (once; a failure is
    logged and leaves every batch on this kernel)."""
    if "reason" not in _tiles:
        why = (
            "the int4 kernel is not available"
            if not available()
            else ""
            if amx_gemm.path() == "AMX" and amx_gemm.available()
            else "no AMX tile path here"
        )
        _tiles["reason"] = why or _tile_self_check()
        if why == "" and _tiles["reason"]:
            log.warning("int4 tile path off, every batch on the int4 kernel: %s", _tiles["reason"])
    return not _tiles["reason"]


def tiles_take(group_size: int, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether layers of this group size and width take the tile path with activations of this dtype."""
    return (
        dtype is torch.bfloat16
        and group_size % 32 == 0
        and group_size <= 256
        and k % group_size == 0
        and tiles_available()
    )


def tile_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    scales_and_zeros: torch.Tensor,
    layout: tuple[int, bool],
    out_dtype: torch.dtype = torch.float32,
    threads: Optional[int] = None,
) -> torch.Tensor:
    """``int4_matmul`` through the AMX tile path (see ``tiles_take``): bf16 ``x`` [M, K], contiguous CPU operands;
    ``threads`` (default torch's) split the groups of 32 output rows between them."""
    m, k = x.shape
    y = torch.empty(m, weight.shape[0], dtype=out_dtype)
    rc = amx_gemm._lib().sidecar_amx_int4_matmul(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            scales=scales_and_zeros.data_ptr(),
            y=y.data_ptr(),
            M=m,
            N=weight.shape[0],
            K=k,
            nthreads=threads or torch.get_num_threads(),
            x_bf16=1,
            out=out_dtype is torch.bfloat16,
            group_size=group_size,
            block_n=layout[0],
            split=layout[1],
        )
    )
    if rc == 2:
        raise MemoryError(f"int4 tile matmul: no memory for the working buffers of {m} activation rows")
    if rc:
        raise ValueError(
            f"int4 tile matmul refused x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"group_size {group_size}, layout {layout}"
        )
    return y


def _tile_self_check() -> str:
    """'' when the tile path computes ``reference`` (to float32 summation error) in every layout, for a row alone as
    in its batch; else what went wrong."""
    g = torch.Generator().manual_seed(0)
    try:
        # tail blocks of 48 and 16 rows; 9 rows on one thread: one panel over four groups of codes, the sums of one
        # group of outputs stored while the next one's are folded
        for m, n, k, gs in ((37, 112, 256, 128), (70, 80, 512, 64), (9, 64, 512, 128)):
            codes = torch.randint(0, 16, (n, k), generator=g)
            sz = torch.randn(k // gs, n, 2, generator=g).bfloat16()
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = reference(x, codes, gs, sz).double()
            for layout in LAYOUTS:
                w = pack(codes, *layout)
                y = tile_matmul(x, w, gs, sz, layout, threads=1 if m == 9 else None)
                if not float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max()):
                    return f"{m} x {n} x {k}, groups of {gs}, layout {layout}: off from the float64 product"
                if not torch.equal(
                    tile_matmul(x[m // 2 : m // 2 + 1], w, gs, sz, layout), y[m // 2 : m // 2 + 1]
                ):
                    return f"{m} x {n} x {k}: a row alone differs from the same row in its batch"
    except (RuntimeError, ValueError) as e:
        return f"self-check failed: {e}"
    return ""


def vector_bits() -> int:
    """The vector width the built kernel uses (512 with AVX-512, else 256); 0 when not built."""
    lib = _KERNEL.lib()
    return 0 if lib is None else lib.sidecar_int4_vector_bits()


def integer_dot() -> bool:
    """Whether the built kernel rounds activations to 16-bit integers (``ACTIVATION_CODE_MAX``, one
    scale per row and group) for its integer dot products (AVX-512 VNNI), else they stay float32."""
    lib = _KERNEL.lib()
    return lib is not None and bool(lib.sidecar_int4_integer_dot())


def int4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    scales_and_zeros: torch.Tensor,
    layout: Optional[tuple[int, bool]] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Requires ``available()``. All on the CPU; ``x`` [M, K] (any M, float32 or bf16 read as they are, other
    dtypes converted), ``weight`` packed uint8 [N, K / 2] (N % 16 == 0) in ``layout`` (default: torch's),
    ``scales_and_zeros`` bf16 [K / group_size, N, 2], group_size a multiple of 16 up to 256. Returns
    ``out_dtype`` [M, N]: float32, or bf16 (the float32 result rounded as ``Tensor.to`` does)."""
    lib = _KERNEL.lib()
    layout = layout or torch_layout()
    assert lib is not None and layout is not None, "int4_gemv kernel is not available"
    m, k = x.shape
    n = weight.shape[0]
    if (
        weight.shape != (n, k // 2)
        or weight.dtype != torch.uint8
        or n % 16
        or k % 2
        or group_size not in range(16, 257, 16)
        or k % group_size
        or scales_and_zeros.shape != (k // group_size, n, 2)
        or scales_and_zeros.dtype != torch.bfloat16
        or out_dtype not in (torch.float32, torch.bfloat16)
    ):
        raise ValueError(
            f"int4_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"group_size {group_size}, scales_and_zeros {tuple(scales_and_zeros.shape)} "
            f"{scales_and_zeros.dtype}, out_dtype {out_dtype} do not fit"
        )
    x = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    weight, sz = weight.contiguous(), scales_and_zeros.contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    rc = lib.sidecar_int4_matmul(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            scales=sz.data_ptr(),
            y=y.data_ptr(),
            M=m,
            N=n,
            K=k,
            nthreads=torch.get_num_threads(),
            x_bf16=x.dtype == torch.bfloat16,
            out=out_dtype == torch.bfloat16,
            group_size=group_size,
            block_n=layout[0],
            split=layout[1],
        )
    )
    if rc == -2:
        raise MemoryError("int4_matmul: no memory for the activation scratch")
    assert rc == 0, "int4_gemv refused arguments checked above"
    return y


class Layer(cpu_build.LayerView):
    """One layer's static operands (``weight``, ``group_size``, ``scales_and_zeros`` as ``int4_matmul`` takes
    them, torch's layout) checked once, so that a call checks only the activations: in a decode step the
    checks and conversions around the product cost more than the product itself for most layers. ``matches``
    says whether it still holds these tensors (the module's buffers may be replaced). bf16 batches of
    ``TILE_MIN_ROWS`` rows or more take the AMX tile path where it runs (``tiles_take``)."""

    __slots__ = ("weight", "sz", "n", "k", "fn", "tiles")

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
        self.tiles = amx_gemm._lib().sidecar_amx_int4_matmul if tiles_take(group_size, k) else None

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
        if self.tiles is not None and m >= TILE_MIN_ROWS and x.dtype is torch.bfloat16:
            rc = self.tiles(
                MatmulArgs(
                    x=x.data_ptr(),
                    w=self.weight.data_ptr(),
                    scales=self.sz.data_ptr(),
                    y=y.data_ptr(),
                    M=m,
                    N=self.n,
                    K=k,
                    nthreads=torch.get_num_threads(),
                    x_bf16=1,
                    out=out_dtype is torch.bfloat16,
                    group_size=gs,
                    block_n=block_n,
                    split=split,
                )
            )
            if rc == 2:
                raise MemoryError(
                    f"int4 tile matmul: no memory for the working buffers of {m} activation rows"
                )
            assert rc == 0, "the int4 tile path refused arguments checked at construction"
            return y
        rc = fn(
            MatmulArgs(
                x=x.data_ptr(),
                w=self.weight.data_ptr(),
                scales=self.sz.data_ptr(),
                y=y.data_ptr(),
                M=m,
                N=self.n,
                K=k,
                nthreads=torch.get_num_threads(),
                x_bf16=x.dtype is torch.bfloat16,
                out=out_dtype is torch.bfloat16,
                group_size=gs,
                block_n=block_n,
                split=split,
            )
        )
        if rc == -2:
            raise MemoryError("int4_matmul: no memory for the activation scratch")
        assert rc == 0, "int4_gemv refused arguments checked at construction"
        return y


def reference(
    x: torch.Tensor, codes: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """x [M, K], plain codes [N, K] (0..15), scales_and_zeros [G, N, 2] -> float32 [M, N] via float64."""
    sz = scales_and_zeros.double()
    s = sz[..., 0].T.repeat_interleave(group_size, dim=1)
    z = sz[..., 1].T.repeat_interleave(group_size, dim=1)
    return (x.double() @ ((codes.double() - 8.0) * s + z).T).float()
