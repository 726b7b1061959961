"""The shapes of multi-head latent attention and of group-limited expert routing (DeepSeek V3, Mistral 4):
what ``ModelArgs.latent`` and ``ModelArgs.routing`` hold. Data only; mla.py and grouped_moe.py read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention: queries from ``q_lora_rank`` (a low-rank projection with its own norm; None:
    one full projection), keys and values of every head expanded from one normed latent of ``kv_lora_rank``
    per token, plus one rotary key part of ``rope_dim`` shared by the heads. Each query/key head is
    ``nope_dim + rope_dim`` wide, each value head ``v_dim``. ``interleave``: the checkpoint's rotary channels
    pair up as (0, 1), (2, 3), ... instead of rotate-half's (i, i + rope_dim / 2). ``query_scale_beta`` /
    ``query_scale_from`` (Mistral 4): queries scaled by ``1 + beta * log(1 + floor(position / from))``."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    interleave: bool = True
    query_scale_beta: Optional[float] = None
    query_scale_from: int = 1

    @property
    def cache_width(self) -> int:
        """Cache elements per token and layer: the latent and the rotary key part."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class GroupedRouting:
    """Group-limited routing with shared experts: each token's expert scores (``sigmoid`` or ``softmax`` of the
    router's logits), plus ``correction_bias`` where the checkpoint has one (DeepSeek V3's
    e_score_correction_bias, used for the choice only), pick the ``topk_group`` best of ``n_group`` expert
    groups (a group's score: the sum of its two best), then the top-k experts inside them; the chosen
    scores, renormalised where ``norm_topk_prob``, times ``scaling``, weigh the experts' outputs.
    ``shared_intermediate_size``: the always-on shared experts' width (0: none)."""

    scoring: str  # "sigmoid" | "softmax"
    correction_bias: bool
    n_group: int
    topk_group: int
    scaling: float
    shared_intermediate_size: int


def latent_attention_parameters(spec: LatentAttention, hidden: int, heads: int, bias: bool) -> int:
    """Parameters of one MLA layer's attention with its two norms around it (as transformers counts them)."""
    qk = spec.nope_dim + spec.rope_dim
    if spec.q_lora_rank is None:
        q = hidden * heads * qk
    else:
        q = hidden * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * heads * qk
        q += spec.q_lora_rank if bias else 0
    kv_a = hidden * spec.cache_width + (spec.cache_width if bias else 0) + spec.kv_lora_rank
    kv_b = spec.kv_lora_rank * heads * (spec.nope_dim + spec.v_dim)
    out = heads * spec.v_dim * hidden + (hidden if bias else 0)
    return q + kv_a + kv_b + out + 2 * hidden
