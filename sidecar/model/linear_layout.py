"""How a CPU model's linear layers hold their weights: ``pack_weights`` picks, once at load, each layer's layout
(oneDNN's packed one, our bf16 kernel's tiled one beside it or alone, AMX's tile layout) and moves a tied head's
table with it (``TiledEmbedding``); ``linear.Linear`` then runs each call on what its layer holds."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

from sidecar.model.kernels.cpu import amx_gemm, bf16_gemv
from sidecar.model.linear import UNLIMITED_ROWS, Linear, can_pack, tile_only

log = logging.getLogger("sidecar.model")

# bf16 weights also get a copy in our kernel's tiled layout (its small batches) while the copies fit this share of RAM
TILED_FRACTION = 0.1


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


def linear_layouts(model) -> dict[str, int]:
    """How many of the model's linear layers hold their weights in each layout: 'tile layout (AMX)' or '(AVX-512
    BF16)' (``amx_gemm``, every batch size), 'oneDNN packed + tiled copy', 'oneDNN packed', 'tiled layout'
    (``bf16_gemv``), 'plain' (F.linear, or a quantized layer's own kernels)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            kind = (
                f"tile layout ({amx_gemm.path()})"
                if m.amx is not None
                else "oneDNN packed + tiled copy"
                if m.packed is not None and m.tiled is not None
                else "oneDNN packed"
                if m.packed is not None
                else "tiled layout"
                if m.tiled is not None
                else "plain"
            )
            counts[kind] = counts.get(kind, 0) + 1
    return counts
