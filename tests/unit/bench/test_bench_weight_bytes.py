"""The throughput bench's roofline bytes a token: a sparse block's experts count the ``top_k`` a token picks,
not all of them (a 128-expert model reads 8 experts a token), dense layers count whole, the embedding table not."""

from __future__ import annotations

from torch import nn

from sidecar.bench.throughput import weight_bytes_per_token


class _Sparse(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(16, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 32, bias=False) for _ in range(experts))


class _Model(nn.Module):
    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 16)
        self.dense = nn.Linear(16, 16, bias=False)
        self.moe = _Sparse(experts, top_k)


def test_a_token_reads_its_picked_experts_only():
    model = _Model(experts=8, top_k=2)
    dense, gate, expert = 16 * 16 * 4, 16 * 8 * 4, 16 * 32 * 4
    assert weight_bytes_per_token(model) == dense + gate + 2 * expert


def test_every_expert_counts_when_each_token_takes_them_all():
    model = _Model(experts=4, top_k=4)
    assert weight_bytes_per_token(model) == 16 * 16 * 4 + 16 * 4 * 4 + 4 * 16 * 32 * 4
