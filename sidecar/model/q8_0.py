"""A tied embedding / lm_head table kept as llama.cpp's Q8_0 blocks: int8 codes and one float scale
per 32 columns (w = d * q), exactly the values of a GGUF file's Q8_0 ``token_embd``.

On CPU the table stays in that form (a quarter of float32's bytes, which is what bounds decode): the
lm_head runs decode-sized batches through our grouped int8 kernel (``kernels/cpu/int8_gemv.c``) and larger
ones, or any batch without the kernel, over float tables dequantized a chunk of rows at a time; the
embedding dequantizes the rows it looks up. Elsewhere the table is dequantized once at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import int8_gemv
from sidecar.model.kernels.cpu.int8_gemv import dequantize_g32

CHUNK_ROWS = 8192


class Q8_0Embedding(nn.Module):
    def __init__(self, weight: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("d", d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_g32(self.weight.index_select(0, flat), self.d.index_select(0, flat), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


class Q8_0Linear(nn.Module):
    """y = x @ W.T for the Q8_0 table W [N, K] (no bias); shares its buffers with the embedding."""

    mode = "q8_0"

    def __init__(self, weight: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("d", d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if (
            x2d.device.type == "cpu"
            and x2d.shape[0] <= int8_gemv.MAX_ROWS
            and int8_gemv.available()
            and x.dtype in (torch.float32, torch.bfloat16)
            and self.d.dtype == torch.float32
        ):
            y = int8_gemv.int8_linear(x2d, self.weight, self.d, None, x.dtype, grouped=True)
        elif x2d.device.type == "cpu" and x2d.shape[0] <= int8_gemv.MAX_ROWS and int8_gemv.available():
            y = int8_gemv.int8_g32_matmul(x2d, self.weight, self.d).to(x.dtype)
        else:
            y = torch.empty(x2d.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            for r in range(0, self.out_features, CHUNK_ROWS):
                w = dequantize_g32(self.weight[r : r + CHUNK_ROWS], self.d[r : r + CHUNK_ROWS], x.dtype)
                y[:, r : r + w.shape[0]] = F.linear(x2d, w)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format=Q8_0"


def tied_q8_0_modules(
    weight: torch.Tensor, d: torch.Tensor, dtype: torch.dtype
) -> tuple[nn.Module, nn.Module]:
    """(embedding, lm_head) over one Q8_0 table (int8 ``weight`` [N, K], float32 ``d`` [N, K/32])."""
    if weight.device.type == "cpu":
        return Q8_0Embedding(weight, d, dtype), Q8_0Linear(weight, d)
    table = nn.Parameter(dequantize_g32(weight, d, dtype), requires_grad=False)
    emb = nn.Embedding(*table.shape, _weight=table, _freeze=True)
    head = nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
    head.weight = table
    return emb, head
