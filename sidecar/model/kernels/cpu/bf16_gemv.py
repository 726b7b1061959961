"""bf16 matmul on CPUs with AVX-512 BF16 or AVX2 + FMA (``bf16_gemv.c``) and its reference.

``bf16_matmul(x, weight, bias, out_dtype)`` computes ``x @ weight.T + bias`` for bf16 ``x`` [M, K] and
``weight`` [N, K] (K a multiple of 32), accumulating in float32 like torch's bf16 matmul, and returns
[M, N] in float32, or rounded once to bf16 (what torch's bf16 linear returns) with ``out_dtype=bfloat16``.
Torch's CPU bf16 GEMM is several times slower at 2-8 rows than at 1, where this kernel's cost barely grows;
at one row it streams the weights faster. ``sidecar.model.linear.Linear`` takes it for bf16 batches of up to
MAX_ROWS rows where it holds a plain weight (see ``linear_layout.pack_weights``).

On a CPU without AVX-512 BF16 (AVX2 only: AMD Zen 2/3, older Intel) the same kernel widens the bf16 values
to float32 (exact) and multiplies with FMAs, in one fixed order as well. oneDNN has no bf16 GEMM there, and
torch's own bf16 matmul runs at a fraction of the float32 one, so there the kernel takes bf16 layers of every
batch size (``isa()`` says which path was built); from 4 rows on it arranges the same sums for arithmetic
rather than for the weight stream (outer products, 6 x 16 register tiles, rows in chunks that stay in L3: at
prefill sizes about as fast as oneDNN's float32 GEMM on half the weight bytes), which is why ``dtype="auto"``
picks bf16 on such CPUs (``hardware.avx2_bf16_kernel``). ``int8_gemm`` runs int8 prefill through the same
outer products.

``tile_weight(weight)`` lays a weight out as [ceil(N/4), K/32, 4, 32] (four rows' 32-value chunks side by
side, zero rows padding the last tile) and ``bf16_matmul_tiled(x, tiled, n, bias, out_dtype)`` takes that
layout: one forward stream per thread, more bandwidth at one row than the plain rows, the same bits.

``sidecar_bf16_moe`` (called by ``moe_cpu``): a sparse block's decode-sized step over bf16 experts held in either
layout, every picked expert's gate/up and down products, silu * up and the weighted sum in one call, each
product the bits its layer's own call gives.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional

import torch

from sidecar.model import hugepages
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import MatmulArgs
from sidecar.model.kernels.cpu.moe_args import MoeArgs

MAX_ROWS = 16
# Row counts at which pack time compares this kernel with oneDNN's packed GEMM (``measure_rows_limit``).
CALIBRATION_ROWS = (2, 4, 8, 16)
ROWS_ENV = "SIDECAR_BF16_KERNEL_ROWS"  # a fixed limit instead of the measured one (1..MAX_ROWS)


# Which path the build runs is asked of the library once: every Linear forward checks it.
_KERNEL = cpu_build.Kernel(
    "bf16_gemv",
    {
        "sidecar_bf16_matmul": ([MatmulArgs], I),
        "sidecar_bf16_matmul_tiled": ([MatmulArgs], I),
        "sidecar_bf16_supported": ([], I),
        "sidecar_bf16_moe": ([MoeArgs], I),  # a sparse block's bf16 experts (moe_cpu.py)
    },
    setup=lambda lib: setattr(lib, "_sidecar_bf16", int(lib.sidecar_bf16_supported())),
)
_ISAS = {512: "avx512_bf16", 2: "avx2"}


def available() -> bool:
    """Built for this CPU, and the CPU has AVX-512 BF16 or AVX2 + FMA."""
    lib = _KERNEL.lib()
    return lib is not None and lib._sidecar_bf16 != 0


def isa() -> str:
    """The path the kernel runs here: "avx512_bf16" (vdpbf16ps on bf16 pairs), "avx2" (bf16 widened to
    float32, FMAs) or "" (not available)."""
    lib = _KERNEL.lib()
    return "" if lib is None else _ISAS.get(lib._sidecar_bf16, "")


def bf16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Requires ``available()``. All tensors on the CPU."""
    lib = _KERNEL.lib()
    assert lib is not None, "bf16_gemv kernel is not available"
    k = x.shape[1]
    n = weight.shape[0]
    if (
        k % 32
        or weight.shape[1] != k
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or (bias is not None and bias.shape != (n,))
        or out_dtype not in (torch.float32, torch.bfloat16)
    ):
        raise ValueError(
            f"bf16_matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)}'}, out {out_dtype} do not fit"
        )
    return _call(lib.sidecar_bf16_matmul, "bf16_matmul", x, weight.contiguous(), n, bias, out_dtype)


def _call(
    fn,
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One call of a checked product: y [M, n] = x @ weight.T + bias (``weight`` in fn's layout)."""
    x = (
        x.contiguous()
    )  # held here (as ``weight`` is by the caller): a temporary would be freed before the call
    b = None
    if bias is not None:
        b = bias.contiguous() if bias.dtype == torch.bfloat16 else bias.float().contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype)
    rc = fn(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            bias=None if b is None else b.data_ptr(),
            y=y.data_ptr(),
            M=x.shape[0],
            N=n,
            K=x.shape[1],
            nthreads=torch.get_num_threads(),
            x_bf16=1,
            bias_bf16=b is not None and b.dtype == torch.bfloat16,
            out=out_dtype == torch.bfloat16,
        )
    )
    if rc == 2:
        raise MemoryError(
            f"{name}: no memory for the working buffers of {x.shape[0]} x {x.shape[1]} activations"
        )
    if rc != 0:
        raise RuntimeError(f"{name}: the kernel was built without AVX-512 BF16 and without AVX2")
    return y


TILE = 4  # weight rows a tile of the tiled layout holds
TILE_CHUNK_BYTES = 4 << 20  # what tile_weight copies at a time when it releases its source


def tile_weight(weight: torch.Tensor, release_source: bool = False) -> torch.Tensor:
    """A bf16 weight [N, K] (K a multiple of 32) in the tiled layout [ceil(N / 4), K / 32, 4, 32].
    ``release_source``: the plain weight is read for the last time (nothing else reads it after): it is copied a
    few MiB at a time and each part's pages are given back once copied (``hugepages.release``), so moving a layer
    (a 259 MiB embedding table) costs no second copy of it at its peak. The copy is fresh memory of torch's
    allocator (huge pages where they are on), wherever the plain weight lived (a file mapping)."""
    n, k = weight.shape
    if k % 32 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"tile_weight: weight {tuple(weight.shape)} {weight.dtype} do not fit a layout of 32-value chunks"
        )
    src = weight.detach()
    whole = src.storage_offset() == 0 and src.untyped_storage().nbytes() == src.numel() * 2  # no view of more
    if not (release_source and whole and src.is_contiguous() and src.device.type == "cpu"):
        pad = -n % TILE
        w = torch.cat([src, src.new_zeros(pad, k)]) if pad else src
        return w.reshape(-1, TILE, k // 32, 32).transpose(1, 2).contiguous()
    tiles, full = -(-n // TILE), n // TILE
    out = torch.empty(tiles, k // 32, TILE, 32, dtype=torch.bfloat16)
    step = max(1, TILE_CHUNK_BYTES // (TILE * k * 2))
    for t in range(0, full, step):
        e = min(full, t + step)
        part = src[t * TILE : e * TILE]
        out[t:e] = part.view(e - t, TILE, k // 32, 32).transpose(1, 2)
        hugepages.release(part.data_ptr(), part.numel() * 2)
    if full < tiles:  # the last tile's rows, then zero rows
        last = src.new_zeros(TILE, k)
        last[: n - full * TILE] = src[full * TILE :]
        out[full] = last.view(TILE, k // 32, 32).transpose(0, 1)
    return out


def untile_weight(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """The plain [n, K] weight back from its ``tile_weight`` layout (a copy)."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1] * 32)[:n].contiguous()


def bf16_matmul_tiled(
    x: torch.Tensor,
    tiled: torch.Tensor,
    n: int,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``bf16_matmul`` over a ``tile_weight`` layout of a weight with ``n`` rows. Requires ``available()``."""
    lib = _KERNEL.lib()
    assert lib is not None, "bf16_gemv kernel is not available"
    k = x.shape[1]
    if (
        tiled.dim() != 4
        or tiled.shape[1:] != (k // 32, TILE, 32)
        or tiled.shape[0] != -(-n // TILE)
        or k % 32
        or x.dtype != torch.bfloat16
        or tiled.dtype != torch.bfloat16
        or not tiled.is_contiguous()
        or (bias is not None and bias.shape != (n,))
        or out_dtype not in (torch.float32, torch.bfloat16)
    ):
        raise ValueError(
            f"bf16_matmul_tiled: x {tuple(x.shape)} {x.dtype}, tiled {tuple(tiled.shape)} "
            f"{tiled.dtype} for {n} rows{'' if bias is None else f', bias {tuple(bias.shape)}'}, "
            f"out {out_dtype} do not fit"
        )
    return _call(lib.sidecar_bf16_matmul_tiled, "bf16_matmul_tiled", x, tiled, n, bias, out_dtype)


class TiledLayer(cpu_build.LayerView):
    """A layer's tiled weight (``tile_weight`` of n rows) and bias checked once, so that a call checks only the
    activations (the checks around the product cost as much as a small layer's product in a decode step).
    ``matches`` says whether it still holds these tensors."""

    __slots__ = ("tiled", "bias", "n", "k", "fn", "bias_bf16")

    def __init__(self, tiled: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> None:
        lib = _KERNEL.lib()
        if lib is None or not lib._sidecar_bf16:
            raise RuntimeError("bf16_gemv kernel is not available")
        if tiled.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
            raise ValueError("bf16 tiled layer: the kernel reads CPU tensors only")
        k = tiled.shape[1] * 32
        bf16_matmul_tiled(torch.zeros(1, k, dtype=torch.bfloat16), tiled, n, bias)  # the checks, once
        if (
            bias is not None
            and bias.dtype not in (torch.bfloat16, torch.float32)
            or not tiled.is_contiguous()
        ):
            raise ValueError("bf16 tiled layer: a bf16 or float32 bias and a contiguous tiled weight")
        self.tiled, self.bias, self.n, self.k = tiled, bias, n, k
        self.bias_bf16 = bias is not None and bias.dtype == torch.bfloat16
        self.fn = lib.sidecar_bf16_matmul_tiled

    def matches(self, tiled: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        return tiled is self.tiled and bias is self.bias and (bias is None or bias.is_contiguous())

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``bf16_matmul_tiled`` for bf16 ``x`` [M, K] on the CPU."""
        if x.dtype is not torch.bfloat16 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"bf16 tiled layer: x {tuple(x.shape)} {x.dtype} for {self.k} bf16 inputs")
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        b = self.bias
        rc = self.fn(
            MatmulArgs(
                x=x.data_ptr(),
                w=self.tiled.data_ptr(),
                bias=None if b is None else b.data_ptr(),
                y=y.data_ptr(),
                M=x.shape[0],
                N=self.n,
                K=self.k,
                nthreads=torch.get_num_threads(),
                x_bf16=1,
                bias_bf16=self.bias_bf16,
                out=out_dtype is torch.bfloat16,
            )
        )
        if rc == 2:
            raise MemoryError(
                f"bf16 tiled layer: no memory for the working buffers of {x.shape[0]} activation rows"
            )
        assert rc == 0, "bf16_gemv refused arguments checked at construction"
        return y


def rows_limit(ours: Callable[[int], float], other: Callable[[int], float], margin: float = 1.2) -> int:
    """The largest of ``CALIBRATION_ROWS`` up to which ``ours(m)`` (seconds for m rows) stays within ``margin``
    of ``other(m)`` at every count (1 at least: one row is a stream of the weights, where this kernel
    leads). The margin keeps a near-tie on this kernel, so noise does not flip the choice between starts
    (the two round bf16 outputs differently: a flip could change a greedy near-tie)."""
    limit = 1
    for m in CALIBRATION_ROWS:
        if ours(m) > margin * other(m):
            break
        limit = m
    return limit


CALIBRATION_BYTES = 96 << 20  # weights one timed pass reads: beyond the caches, as a decode step reads them


def measure_rows_limit(layers: list[tuple[torch.Tensor, int, torch.Tensor]], reps: int = 5) -> int:
    """``rows_limit`` of this kernel against oneDNN's packed GEMM, each timed over one pass through
    ``layers`` ((tiled, rows, packed) of the same weights, in model order) up to ``CALIBRATION_BYTES``
    of them, so that the weights of a large model come from memory as in a decode step (a model that
    fits the caches is read from them then too); the fastest of ``reps`` passes.
    ``$SIDECAR_BF16_KERNEL_ROWS`` replaces the measurement.

    Why measure: where oneDNN's packed GEMM overtakes this kernel depends on the CPU (see
    docs/perf/kernels-notes.md)."""
    fixed = os.environ.get(ROWS_ENV, "").strip()
    if fixed:
        if not fixed.isdigit() or not 1 <= int(fixed) <= MAX_ROWS:
            raise ValueError(f"{ROWS_ENV}: must be an integer in [1, {MAX_ROWS}], got {fixed!r}")
        return int(fixed)
    chosen, total = [], 0
    for layer in layers:
        if total >= CALIBRATION_BYTES:
            break
        chosen.append(layer)
        total += layer[0].numel() * 2
    g = torch.Generator().manual_seed(0)
    xs = {}

    def timer(one: Callable[[torch.Tensor, tuple[torch.Tensor, int, torch.Tensor]], torch.Tensor]):
        def seconds(m: int) -> float:
            for tiled, _, _ in chosen:
                key = (m, tiled.shape[1])
                if key not in xs:
                    xs[key] = torch.randn(m, tiled.shape[1] * 32, generator=g).bfloat16()
            best = math.inf
            for _ in range(reps + 1):  # the first pass warms up
                t = time.perf_counter()
                for layer in chosen:
                    one(xs[(m, layer[0].shape[1])], layer)
                best = min(best, time.perf_counter() - t)
            return best

        return seconds

    with torch.inference_mode():
        return rows_limit(
            timer(lambda x, layer: bf16_matmul_tiled(x, layer[0], layer[1], None, torch.bfloat16)),
            timer(lambda x, layer: torch.ops.mkldnn._linear_pointwise(x, layer[2], None, "none", [None], "")),
        )


def reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()
