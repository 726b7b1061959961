"""Mixture of experts with group-limited routing and shared experts (DeepSeek V3, Mistral 4; the shape in
``latent_args.GroupedRouting``).

Routing as transformers computes it: the router's logits (float32 for DeepSeek V3, whose router HF keeps in
float32; the model dtype for Mistral 4), scored by a sigmoid or a softmax; the choice adds DeepSeek's
``e_score_correction_bias`` to the scores, keeps the ``topk_group`` groups whose two best scores sum highest
(the other experts' choice scores become -inf, or 0 under Mistral 4's softmax) and takes the top-k experts;
their weights are the plain scores of the chosen experts, renormalised where ``norm_topk_prob`` (plus 1e-20)
and multiplied by ``routed_scaling_factor``. The routed experts run as ``SparseMoE`` runs them; the shared
experts (one SwiGLU ``MLP`` of ``n_shared_experts`` experts' width) add their output for every token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from sidecar.model.args import ModelArgs
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.layers import MLP
from sidecar.model.moe import SparseMoE, block_prefix, block_tensors


class GroupedMoE(SparseMoE):
    def __init__(self, args: ModelArgs, paths: Optional[FastPaths] = None) -> None:
        super().__init__(args, paths)
        r = args.routing
        self.routing = r
        self.correction_bias = (
            nn.Parameter(torch.zeros(args.num_experts), requires_grad=False) if r.correction_bias else None
        )
        shared = replace(args, intermediate_size=r.shared_intermediate_size)
        self.shared_experts = MLP(shared, paths) if r.shared_intermediate_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r, e = self.routing, self.num_experts
        logits = self.gate(x)
        if r.scoring == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores if self.correction_bias is None else scores + self.correction_bias.float()
        if r.n_group > 1 and r.topk_group < r.n_group:
            grouped = choice.view(-1, r.n_group, e // r.n_group)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1) if e // r.n_group > 1 else grouped[..., 0]
            keep = torch.zeros_like(best).scatter_(1, best.topk(r.topk_group, dim=-1)[1], 1.0).bool()
            keep = keep[:, :, None].expand_as(grouped).reshape(-1, e)
            hidden = -torch.inf if r.scoring == "sigmoid" else 0.0
            choice = choice.masked_fill(~keep, hidden)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * r.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    def block_tensors(
        self, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], layer_prefix: str
    ) -> Iterator[tuple[Optional[nn.Module], list[tuple[nn.Module, str, torch.Tensor]]]]:
        """``moe.block_tensors`` plus the correction bias (with the router's) and the shared experts (an owner
        of their own, so a loader may quantize them)."""
        prefix = block_prefix(has, layer_prefix, self.args)
        for owner, parts in block_tensors(self, get, has, layer_prefix):
            if owner is None and self.correction_bias is not None:
                parts = parts + [(self, "correction_bias", get(f"{prefix}.gate.e_score_correction_bias"))]
            yield owner, parts
        if self.shared_experts is not None:
            p, mlp = f"{prefix}.shared_experts", self.shared_experts
            gate_up = torch.cat((get(f"{p}.gate_proj.weight"), get(f"{p}.up_proj.weight")))
            yield (
                mlp,
                [
                    (mlp.gate_up_proj, "weight", gate_up),
                    (mlp.down_proj, "weight", get(f"{p}.down_proj.weight")),
                ],
            )
