"""Attention received per cache slot, and how long each slot's token has been receiving it (h2o eviction).

``received`` is the vector the attention paths add to (``AttentionMetadata.kv_scores``, one float32 per cache
slot, ``model/attention_scores.py``): what the token in a slot received, summed over the heads and layers of
every query since it was written. ``written_at`` holds that token's position. A sequence that has computed
``now`` tokens has sent ``now - p`` queries to a token at position ``p`` (its own included), so
``received / (now - p)`` is the mean attention the token got per query. A block is ranked by the mean of
its tokens' means: an accumulated sum ranks a block by its age as much as by its use (an old block has
simply been seen by more queries), which in a chunked prompt lets every older block outrank any newer one.

Both vectors are allocated once, with the runner (four bytes per slot each), and never reallocated: a CPU
decode replay holds ``received``'s address (``cpu_graphs.py``). A slot's entries are reset when a token is
written into it (``for_step``, before the step runs). A block taken from the prefix cache keeps what it
received before (at the same positions).
"""

from __future__ import annotations

import torch


class SlotScores:
    def __init__(self, num_slots: int, block_size: int, device: torch.device) -> None:
        self.num_slots, self.block_size, self.device = num_slots, block_size, device
        self.received = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.written_at = torch.zeros(num_slots, dtype=torch.float32, device=device)

    def for_step(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The vector a step adds to, once the slots it writes (``slots``, holding tokens at ``positions``)
        are reset."""
        self.received.index_fill_(0, slots, 0.0)
        self.written_at.index_copy_(0, slots, positions.to(torch.float32))
        return self.received

    def block_scores(self, block_ids: list[int], now: int) -> torch.Tensor:
        """Each block's mean over its tokens of the attention a token received per query, for a sequence
        that has computed ``now`` tokens (0 before any scored step): float32 [len(block_ids)], on the device."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        got = self.received.view(-1, self.block_size).index_select(0, ids)
        at = self.written_at.view(-1, self.block_size).index_select(0, ids)
        return (got / (now - at).clamp(min=1.0)).mean(dim=1)

    def lowest(self, block_ids: list[int], now: int, k: int) -> list[int]:
        """Indices into ``block_ids`` of the ``k`` blocks of the lowest ``block_scores``, lowest first; on a
        tie the earlier index first. Ranked on the device: only the ``k`` chosen indices come back."""
        if k <= 0 or not block_ids:
            return []
        return torch.sort(self.block_scores(block_ids, now), stable=True).indices[:k].tolist()
