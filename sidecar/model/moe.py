"""Mixture-of-experts MLP: a softmax router picks ``experts_per_token`` SwiGLU experts per token, whose outputs
are summed weighed by the router's probabilities.

Routing follows transformers: the router's logits in the model dtype, their softmax and top-k in float32,
the top-k probabilities renormalised where the family does (``norm_topk_prob``) and kept in float32
(Mixtral) or cast to the model dtype (Qwen3-MoE) before they weigh the outputs; a token's output is the
sum over its k slots in top-k order, in the dtype the weighted outputs promote to, as transformers' grouped
expert forward sums them.

Execution: the step's (token, slot) pairs are sorted by expert, and each expert that any row picked runs
once over all of its rows (``MLP``: a fused gate/up ``Linear`` with silu * up, then the down ``Linear``),
so its weights are read once per step; experts no row picked are not touched. A one-row step reads only
its k experts. The experts are plain per-expert ``Linear`` layers, so the CPU layouts, the int8 / int4
quantized layers and their kernels take them as they take the dense MLP's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.layers import MLP
from sidecar.model.linear import Linear


class SparseMoE(nn.Module):
    """``gate``: the router ([experts, hidden], no bias); ``experts``: one ``MLP`` per expert."""

    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.experts_per_token
        self.norm_topk_prob = args.norm_topk_prob
        self.weights_float32 = args.routing_weights_float32
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        expert = replace(args, intermediate_size=args.expert_intermediate_size, mlp_bias=False)
        self.experts = nn.ModuleList(MLP(expert, paths) for _ in range(args.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of the rows ``x`` [T, hidden], best first."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_float32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the T * k slots grouped by expert, experts ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        slot_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        slots = x.new_empty((t * k, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            rows = x if t == 1 else x.index_select(0, tokens[start:end])
            slots.index_copy_(0, order[start:end], self.experts[e](rows) * slot_weights[start:end])
            start = end
        return slots.view(t, k, -1).sum(dim=1).to(x.dtype)


def block_prefix(has: Callable[[str], bool], layer_prefix: str, args: ModelArgs) -> str:
    """The sparse block's name in a checkpoint: the family's own (the hub's layout, e.g. Mixtral's
    ``block_sparse_moe``), else transformers' module name ``mlp`` (its fused layout)."""
    own = f"{layer_prefix}.{args.moe_names[0]}"
    return own if has(f"{own}.gate.weight") else f"{layer_prefix}.mlp"


def expert_weights(
    get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str, args: ModelArgs
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, gate/up [2 * width, hidden] gate rows first, down [hidden, width]) for each expert of the
    sparse block at ``prefix`` (e.g. ``model.layers.3.mlp``), from the hub's per-expert tensors
    (``experts.<e>.<gate|up|down>.weight``) or transformers' fused ones (``experts.gate_up_proj``
    [experts, 2 * width, hidden] and ``experts.down_proj`` [experts, hidden, width])."""
    _, gate, up, down = args.moe_names
    fused = f"{prefix}.experts.gate_up_proj"
    if has(fused):
        gate_up, downs = get(fused), get(f"{prefix}.experts.down_proj")
        for e in range(args.num_experts):
            yield e, gate_up[e], downs[e]
        return
    for e in range(args.num_experts):
        p = f"{prefix}.experts.{e}"
        yield e, torch.cat((get(f"{p}.{gate}.weight"), get(f"{p}.{up}.weight"))), get(f"{p}.{down}.weight")


def parameter_counts(args: ModelArgs) -> tuple[int, int]:
    """(total, active per token) parameters of the model ``args`` describe: a sparse layer counts its router
    and all of its experts in the total, its router and ``experts_per_token`` experts in the active count."""
    h = args.hidden_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attn = h * (q + 2 * kv) + q * h + 2 * h
    if args.attention_bias:
        attn += q + 2 * kv
    if args.o_proj_bias:
        attn += h
    if args.qk_norm:
        attn += 2 * args.head_dim
    if args.sandwich_norms:
        attn += 2 * h
    dense = 3 * h * args.intermediate_size + (2 * args.intermediate_size + h if args.mlp_bias else 0)
    expert = 3 * h * args.expert_intermediate_size
    total = active = args.vocab_size * h * (1 if args.tie_word_embeddings else 2) + h
    for i in range(args.num_layers):
        if args.sparse(i):
            total += attn + args.num_experts * (h + expert)
            active += attn + args.num_experts * h + args.experts_per_token * expert
        else:
            total += attn + dense
            active += attn + dense
    return total, active
