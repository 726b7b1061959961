"""The models' linear layer: ``nn.Linear`` with the CPU fast paths chosen per call.

On CPU a float32 or bf16 weight is held in oneDNN's blocked layout once at load (``pack``), the layout torch's own
oneDNN GEMM otherwise builds from the plain weight on every call. At the batch sizes of a decode step that per-call
reorder costs as much as the product itself (and torch's default float32 CPU GEMM runs far below an AMD machine's
speed). bf16 results are bit-identical to ``F.linear``; float32 ones differ in summation order only.

The packed layout replaces the plain weight, except where another module reads that weight too (a tied lm_head
shares the embedding table); a float32 table kept so serves the head's batches of up to ``F32_KERNEL_ROWS``
rows through our float32 kernel (``f32_gemv``), faster there. On CPUs where our AVX-512 BF16 kernel runs, bf16
weights whose copies fit in a tenth of the machine's memory also get a copy in that kernel's tiled layout
(``bf16_gemv.tile_weight``), which replaces the plain one: bf16 batches of up to ``kernel_rows`` rows take the
kernel on it, which decodes one row faster than oneDNN on the packed weight; larger batches take the packed one. A
shared weight stays plain and the kernel reads it in place. ``kernel_rows`` (at most ``bf16_gemv.MAX_ROWS``)
is measured once at pack time, where oneDNN overtakes the kernel on this CPU
(``bf16_gemv.measure_rows_limit``).

On a CPU with AMX (Intel Sapphire Rapids on), bf16 weights are held in AMX's tile layout alone
(``amx_gemm.pack``) and our AMX kernel takes every batch size: faster than oneDNN's packed GEMM from one row to
prefill on a 2-core Xeon (the kernel's header has the figures), in one copy of each weight instead of oneDNN's
packed copy beside the tiled one; a tied head's table serves the embedding lookups from the same layout. With
AVX-512 BF16 but no AMX (AMD Zen 4, 5) the same layout and loops run dot products (``amx_gemm.path()``): level
with oneDNN from 16 rows on, ahead below, in one copy there too. Results are float32 sums in another order than
oneDNN's (not F.linear's bits), the same for a row whatever its batch. Where the kernel's start-up self-check
fails, the layers keep oneDNN (``amx_gemm.available``).

Where oneDNN has no bf16 GEMM (AVX2-only CPUs: AMD Zen 2/3, older Intel), torch's bf16 matmul is its own slow
loop, far slower than our kernel at every batch size, and our kernel's AVX2 path (bf16 widened to float32, FMAs)
takes bf16 layers of every batch size: their weights are held in its tiled layout alone (``tile_only``), the plain
copy dropped, so bf16 costs half the memory of float32 there as everywhere.

``SIDECAR_CPU_KERNELS=0`` keeps every layer on plain weights and ``F.linear``: the reference the fast paths are
tested against. Paths that skip a layer's module call (fused epilogues, the GPU's fused products) need ``hooks_idle``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import amx_gemm, bf16_gemv, cpu_build, f32_gemv

log = logging.getLogger("sidecar.model")

UNLIMITED_ROWS = 1 << 62  # kernel_rows of a layer our kernel takes at every batch size (no oneDNN bf16 here)
# A float32 layer kept plain beside its packed copy (a tied head) takes our float32 kernel up to this many rows:
# where it leads oneDNN on the packed copy (the kernel reads the weight once per call, but its register tiles of
# 3 rows x 4 weight rows run under oneDNN's arithmetic rate, which wins past a few rows).
F32_KERNEL_ROWS = 8
PACK_ROWS_HINT = 32  # the batch size oneDNN picks its blocking for: the best of the hints for 1-1024 rows


def hooks_idle(module: nn.Module) -> bool:
    """No hook would change ``module``'s output now: none before it, and each one after it says it is idle."""
    return not module._forward_pre_hooks and all(
        getattr(h, "idle", None) is not None and h.idle() for h in module._forward_hooks.values()
    )


def can_pack(weight: Optional[torch.Tensor]) -> bool:
    """Whether oneDNN on this CPU takes this weight packed (float32 anywhere, bf16 where supported)."""
    if (
        weight is None
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or not cpu_build.enabled()
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def tile_only(weight: Optional[torch.Tensor]) -> bool:
    """Whether this weight is a bf16 one that oneDNN cannot pack on this CPU but our bf16 kernel reads (rows of
    whole 32-element chunks): it is then held in the kernel's tiled layout alone."""
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 32 == 0
        and cpu_build.enabled()
        and not can_pack(weight)
        and bf16_gemv.available()
    )


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict until packed) whose CPU forward takes a packed oneDNN weight
    if it has one, our bf16 kernel for small bf16 batches on its tiled copy (or shared plain weight), else F.linear."""

    kernel_rows = (
        bf16_gemv.MAX_ROWS
    )  # bf16 batches of up to this many rows take our kernel (see linear_layout.pack_weights)
    gate_up_halves = (
        0  # a fused gate/up projection's intermediate size (set by the MLP): the tile layout pairs it
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("tiled", None, persistent=False)
        self.register_buffer("amx", None, persistent=False)  # the weight in the tile layout (amx_gemm.pack)
        self._tiled_layer: Optional[bf16_gemv.TiledLayer] = None  # the kernel's checked view of ``tiled``
        self._amx_layer: Optional[amx_gemm.AmxLayer] = None  # ... and of ``amx``
        self.amx_pairs = 0  # ``amx`` holds a gate/up projection's rows in pairs of this many (amx_gemm.pack)

    def pack(self, keep_weight: bool = False, tile: bool = False, consume: bool = False) -> bool:
        """Hold the weight in oneDNN's layout, and in our bf16 kernel's tiled layout when ``tile``; where oneDNN
        cannot pack it (``tile_only``), in the tiled layout alone, for every batch size. Drop the plain one
        unless ``keep_weight``. ``consume``: nothing outside this model reads the plain weight, so a dropped one's
        pages are given back as the tiled copy is made (``bf16_gemv.tile_weight``'s ``release_source``). With AMX
        or AVX-512 BF16 a bf16 weight goes to the tile layout instead, alone (``amx_gemm.pack``; a gate/up
        projection's rows in pairs, ``gate_up_halves``)."""
        if self.packed is not None or self.tiled is not None or self.amx is not None:
            return False
        release = consume and not keep_weight  # the plain weight is read for the last time
        if amx_gemm.takes(self.weight):  # AMX or AVX-512 BF16: one layout for every batch size
            self.amx_pairs = amx_gemm.pairs_of(self.weight, self.gate_up_halves)
            self.amx = amx_gemm.pack(self.weight.detach(), release, self.amx_pairs)
        elif can_pack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach().contiguous(), PACK_ROWS_HINT
            )
            if tile:
                self.tiled = bf16_gemv.tile_weight(self.weight.detach(), release)
        elif tile_only(self.weight):
            self.tiled = bf16_gemv.tile_weight(self.weight.detach(), release)
            self.kernel_rows = UNLIMITED_ROWS
        else:
            return False
        if not keep_weight:
            self.weight = None
        return True

    def _amx_forward(self, x: torch.Tensor, silu: bool, widened: bool = False) -> torch.Tensor:
        layer = self._amx_layer
        if layer is None or not layer.matches(self.amx, self.bias):
            layer = self._amx_layer = amx_gemm.AmxLayer(
                self.amx, self.out_features, self.bias, self.amx_pairs
            )
        y = layer(
            x.reshape(-1, self.in_features), torch.float32 if widened else torch.bfloat16, silu, widened
        )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def float_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``self(x).float()`` in one pass (bf16 in the tile layout, no hook acting on the output: a model's logits)."""
        if self.amx is None or x.dtype is not torch.bfloat16 or not hooks_idle(self):
            return None
        return self._amx_forward(x, False, True)

    def silu_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(gate) * up of this fused gate/up projection's output in one pass (bf16 in the tile layout, the layer
        held in pairs, no hook acting on its output: an adapter's delta joins the projection before the activation);
        the bits ``norm_act.silu_mul`` gives from ``self(x)``. None where it does not apply."""
        if self.amx is None or not self.amx_pairs or x.dtype is not torch.bfloat16 or not hooks_idle(self):
            return None
        return self._amx_forward(x, True)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (a copy when only the packed or tiled form is held)."""
        if self.weight is not None:
            return self.weight
        if self.packed is not None:
            return self.packed.to_dense()
        if self.amx is not None:
            return amx_gemm.unpack(self.amx, self.out_features, self.amx_pairs)
        return bf16_gemv.untile_weight(self.tiled, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, packed, tiled = self.weight, self.packed, self.tiled
        if self.amx is not None and x.dtype is torch.bfloat16 and x.device.type == "cpu":
            return self._amx_forward(x, False)
        if (
            tiled is not None
            and x.dtype is torch.bfloat16
            and x.numel() <= self.kernel_rows * self.in_features
        ):
            # A tiled copy exists only on the CPU where the kernel runs: its operands are checked once.
            layer = self._tiled_layer
            if layer is None or not layer.matches(tiled, self.bias):
                layer = self._tiled_layer = (
                    bf16_gemv.TiledLayer(tiled, self.out_features, self.bias)
                    if tiled.device.type == "cpu" and bf16_gemv.available()
                    else None
                )
            if layer is not None:
                y = layer(x.reshape(-1, self.in_features))
                return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if (
            w is not None
            and w.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and self.in_features % 32 == 0
            and x.numel() <= self.kernel_rows * self.in_features
            and bf16_gemv.available()
        ):  # a shared plain weight (a tied table), read in place
            y = bf16_gemv.bf16_matmul(x.reshape(-1, self.in_features), w, self.bias, torch.bfloat16)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if (
            packed is not None
            and w is not None
            and x.dtype is torch.float32
            and w.dtype is torch.float32
            and x.numel() <= F32_KERNEL_ROWS * self.in_features
            and f32_gemv.takes(w)
        ):
            # A float32 weight kept plain beside its packed copy (a tied head's table): few rows stream faster
            # through our kernel on the plain rows than through oneDNN on the packed ones.
            y = f32_gemv.f32_matmul(x.reshape(-1, self.in_features), w, self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if packed is not None and x.dtype == packed.dtype and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [None], "")
        return F.linear(x, self.dense_weight(), self.bias)
