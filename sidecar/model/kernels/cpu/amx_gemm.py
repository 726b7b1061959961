"""bf16 matmul through AMX tile products (``amx_gemm.c``) on CPUs that have them (Intel Sapphire Rapids on), and
through AVX-512 BF16 dot products over the same layout and loops on CPUs with AVX-512 BF16 but no AMX (AMD Zen 4 and
5, Intel Cooper Lake): ``path()`` says which.

``pack(weight)`` lays a bf16 weight [N, K] (K a multiple of 32) out as the tiles the product reads
([ceil(N / 32), K / 32, 2, 16, 16, 2], see the C header) and ``AmxLayer(packed, n, bias)`` is a layer's checked
view of it: ``layer(x)`` is ``x @ weight.T + bias`` for bf16 ``x`` [M, K] of any M, accumulated in float32,
returned in float32 or rounded once to bf16. ``sidecar.model.linear.Linear`` holds its bf16 weights in this layout
alone where ``available()``: one copy serves decode steps and prefill, with AMX faster than oneDNN's packed GEMM at
every batch size, without it level from 16 rows on and faster below (docs/perf/kernels-notes.md has the figures).
``rows(packed, ids)`` reads embedding rows out of it (a tied head's table serves the lookups too) and ``unpack``
gives the plain weight back.

``available()`` is the library built with either path (for AMX, the tile state granted to the process), and a
start-up self-check of the kernel against a float64 product (odd shapes, both bias and output dtypes, a row alone
against the same row in a batch); where any of that fails the reason is logged and the layers keep oneDNN's packed
GEMM.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sidecar.model import hugepages
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import OUT_BF16, OUT_F32, OUT_F32_OF_BF16, MatmulArgs

log = logging.getLogger("sidecar.kernels")

GROUP = 32  # output rows a group of the layout holds (two 16-row tiles)
CHUNK_BYTES = 4 << 20  # what pack copies at a time when it releases its source

_KERNEL = cpu_build.Kernel(
    "amx_gemm",
    {
        "sidecar_amx_bf16_matmul": ([MatmulArgs], I),
        "sidecar_amx_bf16_gate_up": ([MatmulArgs], I),
        "sidecar_amx_supported": ([], I),
        "sidecar_amx_int8_matmul": ([MatmulArgs], I),
        "sidecar_amx_int4_matmul": ([MatmulArgs], I),
    },
)
_checked: dict[str, str] = {}  # "reason": why the path is off ('' when it is on), once checked


def _lib():
    lib = _KERNEL.lib()
    return lib if lib is not None and lib.sidecar_amx_supported() else None


def reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    available()
    return _checked["reason"]


def available() -> bool:
    """The AMX path is built, granted and has passed its self-check (run once, at the first ask)."""
    if "reason" not in _checked:
        lib = _KERNEL.lib()
        if lib is None:
            why = f"the kernel did not build: {cpu_build.reason('amx_gemm')}"
        elif not lib.sidecar_amx_supported():
            why = "neither AMX BF16 nor AVX-512 BF16 on this CPU, or the kernel did not grant the tile state"
        else:
            why = _self_check()
        _checked["reason"] = why
        if why and lib is not None and lib.sidecar_amx_supported():
            log.warning("%s bf16 matmul off, layers keep oneDNN's packed GEMM: %s", path(), why)
    return not _checked["reason"]


def path() -> str:
    """What multiplies in this layout here: 'AMX' (tile products), 'AVX-512 BF16' (dot products over the same
    layout, on a CPU without AMX), or '' (neither: the kernel did not build or the CPU has neither)."""
    lib = _KERNEL.lib()
    return {1: "AMX", 2: "AVX-512 BF16"}.get(lib.sidecar_amx_supported() if lib is not None else 0, "")


def takes(weight: Optional[torch.Tensor]) -> bool:
    """Whether a layer's weight goes to this layout: a bf16 CPU matrix of rows of whole 32-value chunks, with the
    path available."""
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 32 == 0
        and weight.shape[1] > 0
        and cpu_build.enabled()
        and available()
    )


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """Whole groups of plain rows [32 g, K] as their tiles [g, K / 32, 2, 16, 16, 2]."""
    g, k = w.shape[0] // GROUP, w.shape[1]
    return w.view(g, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)


def pairs_of(weight: Optional[torch.Tensor], halves: int) -> int:
    """``halves`` where a weight of 2 x ``halves`` rows (a fused gate/up projection) can be held in gate/up pairs
    (``pack(pairs=halves)``: the kernel then offers silu(gate) * up in its epilogue), else 0."""
    return (
        halves
        if halves > 0 and halves % 16 == 0 and weight is not None and weight.shape[0] == 2 * halves
        else 0
    )


def pack(weight: torch.Tensor, release_source: bool = False, pairs: int = 0) -> torch.Tensor:
    """A bf16 weight [N, K] in the tile layout. ``release_source``: the plain weight is read for the last time, so
    it is copied a few MiB at a time and each part's pages are given back once copied (``hugepages.release``): no
    second copy at the peak (as ``bf16_gemv.tile_weight``). ``pairs`` (``pairs_of``): the rows of a fused gate/up
    projection, gate rows 0..pairs-1 and up rows pairs..N-1, go in pairs -- group g holds gate rows 16 g.. and the
    up rows 16 g.. (``AmxLayer`` gives the projection's own column order back, or silu(gate) * up)."""
    n, k = weight.shape
    if k % 32 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"amx pack: weight {tuple(weight.shape)} {weight.dtype} is not bf16 rows of 32-value chunks"
        )
    if pairs and pairs_of(weight, pairs) != pairs:
        raise ValueError(
            f"amx pack: {n} rows are not gate/up pairs of {pairs} (a multiple of 16, half the rows)"
        )
    src = weight.detach()
    groups, full = -(-n // GROUP), n // GROUP
    out = torch.empty(groups, k // 32, 2, 16, 16, 2, dtype=torch.bfloat16)
    whole = src.storage_offset() == 0 and src.untyped_storage().nbytes() == src.numel() * 2
    release = release_source and whole and src.is_contiguous() and src.device.type == "cpu"
    step = max(1, CHUNK_BYTES // (GROUP * k * 2))
    for g in range(0, full, step):
        e = min(full, g + step)
        if pairs:  # each group: gate rows 16 g.., then up rows 16 g..
            halves = (src[g * 16 : e * 16], src[pairs + g * 16 : pairs + e * 16])
            part = torch.stack([h.reshape(e - g, 16, k) for h in halves], 1).reshape(-1, k)
        else:
            halves = (src[g * GROUP : e * GROUP],)
            part = halves[0].contiguous()
        out[g:e] = _tiles(part)
        if release:
            for h in halves:
                hugepages.release(h.data_ptr(), h.numel() * 2)
    if full < groups:  # the last group's rows, then zero rows
        last = src.new_zeros(GROUP, k)
        last[: n - full * GROUP] = src[full * GROUP :]
        out[full] = _tiles(last)[0]
    return out


def unpack(packed: torch.Tensor, n: int, pairs: int = 0) -> torch.Tensor:
    """The plain [n, K] weight back from its ``pack`` layout (a copy)."""
    g, kb = packed.shape[:2]
    rows = packed.permute(0, 2, 4, 1, 3, 5).reshape(g * GROUP, kb * 32)
    if pairs:  # [group][gate | up][16] back to [gate | up][group][16]
        return rows.view(g, 2, 16, kb * 32).transpose(0, 1).reshape(n, kb * 32).contiguous()
    return rows[:n].contiguous()


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape, in range) of the weight held as ``packed``: [*ids.shape, K]."""
    flat = ids.reshape(-1)
    g, h, j = flat // GROUP, (flat % GROUP) // 16, flat % 16
    out = packed[g, :, h, :, j, :]  # [n, K / 32, 16, 2]
    return out.reshape(*ids.shape, packed.shape[1] * 32)


class AmxLayer(cpu_build.LayerView):
    """A layer's packed weight (``pack`` of n rows) and bias checked once, so that a call checks only the
    activations. ``matches`` says whether it still holds these tensors."""

    __slots__ = ("packed", "bias", "n", "k", "fn", "bias_bf16", "pairs", "gate_up")

    def __init__(self, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor], pairs: int = 0) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("amx_gemm: the AMX path is not available")
        if packed.dim() != 6 or packed.shape[2:] != (2, 16, 16, 2) or packed.dtype != torch.bfloat16:
            raise ValueError(f"amx layer: {tuple(packed.shape)} {packed.dtype} is not a packed bf16 weight")
        k = packed.shape[1] * 32
        if (
            packed.shape[0] != -(-n // GROUP)
            or not packed.is_contiguous()
            or packed.device.type != "cpu"
            or k == 0
        ):
            raise ValueError(f"amx layer: {tuple(packed.shape)} does not hold {n} contiguous CPU rows")
        if bias is not None and (
            bias.shape != (n,)
            or bias.dtype not in (torch.bfloat16, torch.float32)
            or bias.device.type != "cpu"
        ):
            raise ValueError(f"amx layer: bias {tuple(bias.shape)} {bias.dtype} for {n} outputs")
        if pairs and (pairs % 16 or n != 2 * pairs):
            raise ValueError(f"amx layer: {n} outputs are not gate/up pairs of {pairs}")
        self.packed, self.bias, self.n, self.k, self.pairs = packed, bias, n, k, pairs
        self.bias_bf16 = bias is not None and bias.dtype == torch.bfloat16
        self.fn = lib.sidecar_amx_bf16_matmul
        self.gate_up = lib.sidecar_amx_bf16_gate_up

    def matches(self, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        return packed is self.packed and bias is self.bias and (bias is None or bias.is_contiguous())

    def __call__(
        self,
        x: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        silu: bool = False,
        widened: bool = False,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for bf16 ``x`` [M, K] on the CPU, in ``out_dtype`` (bf16 or float32). ``silu``, for
        a layer held in gate/up pairs: silu(gate) * up [M, n / 2] in bf16, the bits ``norm_act.silu_mul`` gives from
        the bf16 projection, in one pass. ``widened`` (float32 only): the bf16 output's values, as float32 -- the
        bits of ``self(x).float()`` without the second pass."""
        if x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"amx layer: x {tuple(x.shape)} {x.dtype} for {self.k} bf16 inputs")
        if (
            out_dtype not in (torch.bfloat16, torch.float32)
            or silu
            and (out_dtype is not torch.bfloat16 or not self.pairs)
            or widened
            and (out_dtype is not torch.float32 or silu)
        ):
            raise ValueError(
                f"amx layer: output {out_dtype}{' with silu' if silu else ''}"
                f"{' widened' if widened else ''} is not what it gives"
            )
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.n // 2 if silu else self.n, dtype=out_dtype)
        b = self.bias  # checked at construction (a replaced bias is another layer: ``matches``)
        args = MatmulArgs(
            x=x.data_ptr(),
            w=self.packed.data_ptr(),
            bias=None if b is None else b.data_ptr(),
            y=y.data_ptr(),
            M=x.shape[0],
            N=self.pairs or self.n,  # a gate/up layer: its gate rows
            K=self.k,
            nthreads=torch.get_num_threads(),
            x_bf16=1,
            bias_bf16=self.bias_bf16,
            out=OUT_F32_OF_BF16 if widened else OUT_BF16 if out_dtype is torch.bfloat16 else OUT_F32,
            silu=silu,
        )
        rc = self.gate_up(args) if self.pairs else self.fn(args)
        if rc == 2:
            raise MemoryError(f"amx layer: no memory for the working sums of {x.shape[0]} activation rows")
        assert rc == 0, "amx_gemm refused arguments checked at construction"
        return y


def int8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> Optional[torch.Tensor]:
    """``(x @ weight.T) * scales + bias`` for bf16 ``x`` [M, K] and int8 codes ``weight`` [N, K] (K a multiple of 32)
    with float32 ``scales`` [N], through tile products over the codes widened to bf16 (exact): float32 sums, times the
    row's scale, then the bias, rounded once to ``out_dtype`` (float32 or bf16). None where the path is not available;
    the caller has checked the static operands (contiguous, on the CPU)."""
    lib = _lib()
    if (
        lib is None
        or not available()
        or x.dtype is not torch.bfloat16
        or x.dim() != 2
        or weight.shape[1] % 32
    ):
        return None
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    rc = lib.sidecar_amx_int8_matmul(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            scales=scales.data_ptr(),
            bias=None if bias is None else bias.data_ptr(),
            y=y.data_ptr(),
            M=x.shape[0],
            N=weight.shape[0],
            K=weight.shape[1],
            nthreads=torch.get_num_threads(),
            x_bf16=1,
            bias_bf16=bias is not None and bias.dtype == torch.bfloat16,
            out=OUT_BF16 if out_dtype is torch.bfloat16 else OUT_F32,
        )
    )
    if rc == 2:
        raise MemoryError(
            f"amx int8 matmul: no memory for the working buffers of {x.shape[0]} activation rows"
        )
    return y if rc == 0 else None


def _self_check() -> str:
    """'' when the kernel computes what a float64 product computes (to float32 summation error), for a row alone
    as in a batch; else what went wrong."""
    g = torch.Generator().manual_seed(0)
    try:
        for m, n, k, bias_dtype, out_dtype in (
            (37, 70, 96, torch.float32, torch.float32),
            (1, 45, 64, torch.bfloat16, torch.bfloat16),
            (70, 64, 32, None, torch.bfloat16),
        ):
            w = torch.randn(n, k, generator=g).bfloat16()
            x = torch.randn(m, k, generator=g).bfloat16()
            b = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
            layer = AmxLayer(pack(w), n, b)
            y = layer(x, out_dtype)
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            err = float((y.double() - ref).abs().max())
            bound = (1e-5 if out_dtype is torch.float32 else 1e-2) * float(ref.abs().max())
            if not err <= bound:
                return f"{m} x {n} x {k}: off by {err:.3g} from the float64 product (bound {bound:.3g})"
            if out_dtype is torch.bfloat16 and not torch.equal(
                layer(x, torch.float32, widened=True), y.float()
            ):
                return f"{m} x {n} x {k}: the widened float32 output is not the bf16 output's values"
            if not torch.equal(layer(x[m // 2 : m // 2 + 1], out_dtype), y[m // 2 : m // 2 + 1]):
                return f"{m} x {n} x {k}: a row alone differs from the same row in its batch"
            if not torch.equal(unpack(layer.packed, n), w):
                return "the packed layout does not give the weight back"
        w = torch.randn(
            64, 96, generator=g
        ).bfloat16()  # a gate/up projection of 2 x 32 outputs, held in pairs
        x = torch.randn(19, 96, generator=g).bfloat16()
        b = torch.randn(64, generator=g).bfloat16()
        paired = AmxLayer(pack(w, pairs=32), 64, b, pairs=32)
        gu = AmxLayer(pack(w), 64, b)(x)
        if not torch.equal(paired(x), gu) or not torch.equal(unpack(paired.packed, 64, 32), w):
            return "the gate/up pairs do not give the projection's own outputs"
        act = (
            torch.nn.functional.silu(gu[:, :32].float()).bfloat16().float() * gu[:, 32:].float()
        ).bfloat16()
        if not (paired(x, silu=True).float() - act.float()).abs().max() <= 1e-2 * float(
            act.float().abs().max()
        ):
            return "silu(gate) * up from the gate/up pairs is off"
        codes = torch.randint(
            -127, 128, (70, 96), generator=g, dtype=torch.int8
        )  # int8 codes, per-row scales
        scales = torch.rand(70, generator=g) + 0.5
        x = torch.randn(67, 96, generator=g).bfloat16()
        lib = _lib()
        y8 = torch.empty(67, 70)
        if (
            lib.sidecar_amx_int8_matmul(
                MatmulArgs(
                    x=x.data_ptr(),
                    w=codes.data_ptr(),
                    scales=scales.data_ptr(),
                    y=y8.data_ptr(),
                    M=67,
                    N=70,
                    K=96,
                    nthreads=torch.get_num_threads(),
                    x_bf16=1,
                    out=OUT_F32,
                )
            )
            != 0
        ):
            return "the int8 product refused its arguments"
        ref = (x.double() @ codes.double().T) * scales.double()
        if not float((y8.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max()):
            return "the int8 product is off from its float64 reference"
    except (RuntimeError, ValueError) as e:
        return f"self-check failed: {e}"
    return ""
