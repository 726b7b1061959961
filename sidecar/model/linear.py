"""The models' linear layer: ``nn.Linear`` with the CPU fast paths chosen per call.

On CPU a float32 or bf16 weight is held in oneDNN's blocked layout once at load (``pack``), the layout torch's own
oneDNN GEMM otherwise builds from the plain weight on every call. At the batch sizes of a decode step that per-call
reorder costs as much as the product itself: measured on Zen 5 (2 threads, Qwen2-0.5B's layers), a 32-row bf16
gate/up product 1.50 -> 0.93 ms and the 32-row lm_head 23.5 -> 15.6 ms, and float32 -- where torch's default CPU
GEMM runs far below this AMD machine's speed -- 4.3x faster at 32 rows and 4.1x at one row. bf16 results are
bit-identical to ``F.linear``; float32 ones differ in summation order only.

The packed layout replaces the plain weight, except where another module reads that weight too (a tied lm_head
shares the embedding table); a float32 table kept so serves the head's batches of up to ``F32_KERNEL_ROWS``
rows through our float32 kernel (``f32_gemv``), faster there. On CPUs where our AVX-512 BF16 kernel runs, bf16
weights whose copies fit in a tenth of the machine's memory also get a copy in that kernel's tiled layout
(``bf16_gemv.tile_weight``), which replaces the plain one: bf16 batches of up to ``kernel_rows`` rows take the
kernel on it, which decodes one row faster than oneDNN on the packed weight (~7-12% from plain rows on Zen 5,
whole Qwen2-0.5B; the tiled rows stream ~12% faster again on Zen 4); larger batches take the packed one. A
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
loop (measured on a 2-core Zen 3, a 4,864 x 896 layer: ~17 GFLOP/s from 16 rows up, a sixth of our kernel;
2.5x its time at one row), and our kernel's AVX2 path (bf16 widened to float32, FMAs) takes bf16 layers of
every batch size: their weights are held in its tiled layout alone (``tile_only``), the plain copy dropped, so
bf16 costs half the memory of float32 there as everywhere.

``SIDECAR_CPU_KERNELS=0`` keeps every layer on plain weights and ``F.linear``: the reference the fast paths are
tested against. Paths that skip a layer's module call (fused epilogues, the GPU's fused products) need ``hooks_idle``.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import amx_gemm, bf16_gemv, cpu_build, f32_gemv

log = logging.getLogger("sidecar.model")

UNLIMITED_ROWS = 1 << 62  # kernel_rows of a layer our kernel takes at every batch size (no oneDNN bf16 here)
# A float32 layer kept plain beside its packed copy (a tied head) takes our float32 kernel up to this many rows:
# measured on a 2-core Zen 3, Qwen2-0.5B's head (151,936 x 896), against oneDNN on the packed copy: 1.15x at one
# row, 1.5-1.6x at 2-4, 1.3x at 8, even at 16, slower from there (the kernel reads the weight once per call, but
# its register tiles of 3 rows x 4 weight rows run under oneDNN's arithmetic rate).
F32_KERNEL_ROWS = 8
PACK_ROWS_HINT = 32  # the batch size oneDNN picks its blocking for; measured best for 1-1024 rows
# bf16 weights also get a copy in our kernel's tiled layout (its small batches) while the copies fit this share of RAM
TILED_FRACTION = 0.1


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
    )  # bf16 batches of up to this many rows take our kernel (see pack_weights)
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


class TiledEmbedding(nn.Module):
    """The lookup of an embedding table held in our bf16 kernel's tiled layout (``bf16_gemv.tile_weight``) or in
    AMX's tile layout (``amx_gemm.pack``, ``layout="amx"``): the copy of a tied lm_head, so that one table serves
    both. Row ``i`` is read out of its tiles."""

    def __init__(
        self, tiled: torch.Tensor, num_embeddings: int, embedding_dim: int, layout: str = "tiled"
    ) -> None:
        super().__init__()
        if layout not in ("tiled", "amx"):
            raise ValueError(f"embedding layout {layout!r}: 'tiled' or 'amx'")
        self.num_embeddings, self.embedding_dim, self.layout = num_embeddings, embedding_dim, layout
        self.register_buffer("tiled", tiled, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"embedding: token id out of range [0, {self.num_embeddings})")
        if self.layout == "amx":
            return amx_gemm.rows(self.tiled, ids)
        rows = self.tiled[flat // bf16_gemv.TILE, :, flat % bf16_gemv.TILE, :]  # [n, K / 32, 32]
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, layout={self.layout}"


def _embedding_holders(model: nn.Module, weight: torch.Tensor) -> Optional[list[tuple[nn.Module, str]]]:
    """(parent, attribute) of every module other than a Linear holding ``weight``, when all of them are plain
    lookups (nn.Embedding without max_norm); None when some other kind of module reads it."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear) or not any(p is weight for p in child.parameters(recurse=False)):
                continue
            if not isinstance(child, nn.Embedding) or child.max_norm is not None:
                return None
            found.append((parent, name))
    return found or None


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def pack_weights(model: nn.Module, consume: bool = False) -> int:
    """Pack every full-precision ``Linear`` of a CPU model; returns how many were packed. A weight
    another module holds too (a tied lm_head's embedding table) is kept beside its packed copy; other
    bf16 weights, where our bf16 kernel runs, get a copy in its tiled layout when those copies take at
    most ``TILED_FRACTION`` of the machine's memory: the kernel decodes one row from them faster
    than oneDNN does from the packed layout. bf16 weights oneDNN cannot pack here go to the tiled layout
    alone (``tile_only``). ``consume``: the model's plain weights are its own (the loader's, just read), so a
    plain weight that is dropped gives its pages back while its tiled copy is made (``Linear.pack``)."""
    n = _tile_alone(model, consume)
    linears = [
        m for m in model.modules() if isinstance(m, Linear) and m.packed is None and can_pack(m.weight)
    ]
    others = {
        p.data_ptr()
        for m in model.modules()
        if not isinstance(m, Linear)
        for p in m.parameters(recurse=False)
    }
    shared = {id(m) for m in linears if m.weight.data_ptr() in others}
    # Tiled copies only where the kernel can read them (a row length of whole 32-element chunks).
    bf16 = [
        m
        for m in linears
        if m.weight.dtype == torch.bfloat16 and id(m) not in shared and m.in_features % 32 == 0
    ]
    tiled_bytes = sum(
        m.weight.numel() * 2 for m in bf16
    )  # what the copies cost (shared ones stay plain anyway)
    kernel_read = {id(m) for m in bf16}
    amx = bool(bf16) and amx_gemm.takes(bf16[0].weight)  # bf16 weights in the tile layout alone (Linear.pack)
    tile = (
        bool(bf16)
        and not amx
        and bf16_gemv.available()
        and tiled_bytes <= TILED_FRACTION * _physical_memory()
    )
    # A tied lm_head's table moves to the tiled layout too where the kernel runs, when only embedding lookups
    # share it: they read their rows out of the tiles, so the one copy serves the head's kernel (a faster stream
    # than plain rows) and the lookups, in the memory the plain table took.
    tied = {}
    if tile or amx:
        for m in linears:
            if (
                id(m) in shared
                and m.weight.dtype == torch.bfloat16
                and m.in_features % 32 == 0
                and (holders := _embedding_holders(model, m.weight)) is not None
            ):
                tied[id(m)] = holders
    packed = 0
    for lin in linears:
        if id(lin) in tied:
            packed += _tile_table(lin, tied[id(lin)], consume)
            continue
        packed += lin.pack(
            keep_weight=id(lin) in shared, tile=tile and id(lin) in kernel_read, consume=consume
        )
    if tile:
        # Where oneDNN overtakes our kernel on this CPU, measured over the tiled layers; every bf16 layer the
        # kernel reads (the shared plain ones too) switches there.
        rows = bf16_gemv.measure_rows_limit(
            [(m.tiled, m.out_features, m.packed) for m in linears if m.tiled is not None]
        )
        for lin in linears:
            if lin.weight is not None or lin.tiled is not None:
                lin.kernel_rows = rows
    if packed:
        log.info(
            "linear layers: %d packed%s",
            packed,
            f"; bf16 copies in the decode kernel's tiled layout ({tiled_bytes / 2**20:.0f} MiB), which "
            f"takes batches of up to {rows} rows"
            if tile
            else f"; bf16 ones in the tile layout alone ({amx_gemm.path()})"
            if amx
            else " for oneDNN",
        )
    return n + packed


def _tile_table(lin: Linear, holders: list[tuple[nn.Module, str]], consume: bool = False) -> bool:
    """A tied head's table to the tiled layout, the embedding lookups reading their rows out of the tiles."""
    table = lin.weight
    done = lin.pack(tile=True, consume=consume)
    if done:
        layout = "tiled" if lin.amx is None else "amx"
        for parent, name in holders:
            setattr(
                parent,
                name,
                TiledEmbedding(
                    lin.tiled if lin.amx is None else lin.amx, table.shape[0], table.shape[1], layout
                ),
            )
    return done


def _tile_alone(model: nn.Module, consume: bool = False) -> int:
    """bf16 layers oneDNN cannot pack on this CPU (``tile_only``) to our kernel's tiled layout, which replaces the
    plain weight and takes every batch size; a tied table too when only embedding lookups share it (else it stays
    plain and the kernel reads its rows in place). Returns how many layers moved."""
    linears = [
        m for m in model.modules() if isinstance(m, Linear) and m.tiled is None and tile_only(m.weight)
    ]
    if not linears:
        return 0
    others = {
        p.data_ptr()
        for m in model.modules()
        if not isinstance(m, Linear)
        for p in m.parameters(recurse=False)
    }
    n = 0
    for lin in linears:
        if lin.weight.data_ptr() not in others:
            n += lin.pack(consume=consume)
        elif (holders := _embedding_holders(model, lin.weight)) is not None:
            n += _tile_table(lin, holders, consume)
        else:
            lin.kernel_rows = UNLIMITED_ROWS  # plain rows, read in place
    log.info(
        "linear layers: %d bf16 ones in our kernel's tiled layout alone (%s path; no oneDNN bf16 on this "
        "CPU), every batch size",
        n,
        bf16_gemv.isa(),
    )
    return n
