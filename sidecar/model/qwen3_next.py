"""Qwen3-Next: the hybrid Qwen3.5 grew from (qwen3_5.py: gated DeltaNet layers among gated full-attention
layers, norms scaling by ``1 + w``, partial rotary), with mixture-of-experts MLPs as Qwen3.5-MoE's (a
softmax router, renormalised where ``norm_topk_prob``, and a shared expert gated by the sigmoid of
``shared_expert_gate``) on the layers Qwen3-MoE's rule picks: not in ``mlp_only_layers`` and with
``(index + 1)`` a multiple of ``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``.

Its DeltaNet stores the input projections grouped by key head: ``in_proj_qkvz`` holds, for each of the
``linear_num_key_heads`` key heads, its q and k rows, then the v and z rows of the value heads it serves;
``in_proj_ba`` the b then the a rows of those value heads. ``checkpoint_view`` regroups the rows into
Qwen3.5's projections (``in_proj_qkv`` as q of every head, then k, then v; ``in_proj_z``; ``in_proj_b``;
``in_proj_a``), which is the order HF's forward brings them into before the convolution."""

from __future__ import annotations

from typing import Any

import torch

from sidecar.model.args import ModelArgs
from sidecar.model.qwen3_5 import expert_args, hybrid_args


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"model: {arch} decoder_sparse_step must be a positive integer, got {step!r}")
    only = cfg.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or not 0 <= i < n for i in only):
        raise ValueError(f"model: {arch} mlp_only_layers {only!r} must be layer indices below {n}")
    if not cfg.get("num_experts"):
        return hybrid_args(cfg, arch)
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
    return hybrid_args(cfg, arch, **expert_args(cfg, arch, dense, bool(cfg.get("norm_topk_prob", True))))


def regroup(args: ModelArgs, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Qwen3-Next DeltaNet projection (``...in_proj_qkvz.weight`` or ``...in_proj_ba.weight``) as Qwen3.5's
    (``in_proj_qkv`` and ``in_proj_z``, or ``in_proj_b`` and ``in_proj_a``), keyed by their names."""
    s = args.linear
    r = s.num_v_heads // s.num_k_heads  # value heads per key head
    base = name[: -len("qkvz.weight")] if name.endswith("qkvz.weight") else name[: -len("ba.weight")]
    groups = t.reshape(s.num_k_heads, -1, t.shape[-1])
    if name.endswith("qkvz.weight"):
        q, k, v, z = groups.split([s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim], dim=1)
        qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        return {f"{base}qkv.weight": qkv, f"{base}z.weight": z.reshape(-1, t.shape[-1])}
    b, a = groups.split([r, r], dim=1)
    return {f"{base}b.weight": b.reshape(-1, t.shape[-1]), f"{base}a.weight": a.reshape(-1, t.shape[-1])}


class _NextNames:
    """A checkpoint index (``get`` / ``__contains__``, as the loader reads it) with each DeltaNet's grouped
    projections seen as Qwen3.5's four."""

    SPLIT = {"qkv": "qkvz", "z": "qkvz", "b": "ba", "a": "ba"}

    def __init__(self, args: ModelArgs, ckpt: Any) -> None:
        self.args, self.ckpt = args, ckpt

    def _source(self, name: str) -> str:
        head, sep, tail = name.rpartition(".linear_attn.in_proj_")
        kind = tail[: -len(".weight")] if sep and tail.endswith(".weight") else ""
        if kind not in self.SPLIT:
            return name
        return f"{head}.linear_attn.in_proj_{self.SPLIT[kind]}.weight"

    def __contains__(self, name: str) -> bool:
        return self._source(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        source = self._source(name)
        if source == name:
            return self.ckpt.get(name)
        return regroup(self.args, source, self.ckpt.get(source))[name]

    def __getattr__(self, name: str) -> Any:  # the index's other fields (weight_map, paths)
        return getattr(self.ckpt, name)


def checkpoint_view(args: ModelArgs, ckpt: Any) -> Any:
    """``ckpt`` with Qwen3-Next's DeltaNet projections regrouped (see the module's docstring)."""
    return _NextNames(args, ckpt)
