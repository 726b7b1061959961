"""Llama 4 (text): the config mapping and the checkpoint's names.

Layers with rope attend within chunks of ``attention_chunk_size`` tokens (``layer_types`` "chunked_attention"),
the NoPE layers (``no_rope_layers``: 0 marks one; by default every ``no_rope_layer_interval``-th) attend to
every key without rope, their queries scaled by the attention temperature (``attn_temperature_tuning``,
``floor_scale``, ``attn_scale``). Rope rotates interleaved channel pairs (HF's complex form); with
``use_qk_norm`` the rope layers L2-normalise each q and k head after rope (attention_local.py). The layers
in ``moe_layers`` (by default every ``interleave_moe_layer_step``-th) are mixtures of experts of width
``intermediate_size`` with a sigmoid top-k router weighing each expert's input and a shared expert of the
same width (moe.py); the others are dense MLPs of width ``intermediate_size_mlp``.

Checkpoint names: the MLP is ``feed_forward`` (ours ``mlp``), the router ``feed_forward.router``, the experts
fused and stored inputs first (``experts.gate_up_proj`` [experts, hidden, 2 * width], ``experts.down_proj``
[experts, width, hidden]); ``checkpoint_view`` presents them under the names and layouts the loader reads. A
``Llama4ForConditionalGeneration`` checkpoint serves its text model (``text_config``, tensors under
``language_model.``); the vision tower is not loaded, so prompts are text only.
"""

from __future__ import annotations

from typing import Any

import torch

from sidecar.model.args import ModelArgs, base_args

_CONDITIONAL = "Llama4ForConditionalGeneration"


def _text_config(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], str]:
    if "text_config" not in cfg:
        return cfg, "model."
    text = cfg["text_config"]
    tied = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return dict(text, tie_word_embeddings=tied), "language_model.model."


def args_from_config(cfg: dict[str, Any], arch: str) -> ModelArgs:
    cfg, prefix = _text_config(cfg, arch)
    n = cfg["num_hidden_layers"]
    interval = int(cfg.get("no_rope_layer_interval", 4))
    use_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size", 8192)
    types = cfg.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in use_rope
    ]
    if len(use_rope) < n or len(types) != n or set(types) - {"chunked_attention", "full_attention"}:
        raise ValueError(f"model: {arch} no_rope_layers / layer_types must name each of the {n} layers")
    if chunk is not None and int(chunk) <= 0:
        raise ValueError(f"model: {arch} attention_chunk_size must be positive, got {chunk}")
    step = int(cfg.get("interleave_moe_layer_step", 1))
    moe = cfg.get("moe_layers")
    moe = set(range(step - 1, n, step) if moe is None else moe)
    experts = int(cfg.get("num_local_experts", 16))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: {arch} hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    tuning = cfg.get("attn_temperature_tuning", True)
    width = cfg["intermediate_size"]
    return base_args(
        cfg,
        arch,
        intermediate_size=cfg.get("intermediate_size_mlp", 16384),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(
            (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 500000.0))
        ),
        layer_chunks=tuple(int(chunk) if t == "chunked_attention" else None for t in types),
        nope_layers=tuple(i for i in range(n) if not use_rope[i]),
        interleaved_rope=True,
        qk_l2_norm=bool(cfg.get("use_qk_norm", True)),
        attn_temperature=(
            (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1))) if tuning else None
        ),
        num_experts=experts if moe else 0,
        experts_per_token=int(cfg.get("num_experts_per_tok", 1)),
        expert_intermediate_size=width,
        dense_layers=tuple(i for i in range(n) if i not in moe),
        router_sigmoid_input=True,
        shared_expert_size=width,
        checkpoint_prefix=prefix,
    )


class _Llama4Names:
    """A checkpoint index seen with our names (``get`` / ``__contains__``, as the loader reads it)."""

    def __init__(self, ckpt: Any, head: str) -> None:
        self.ckpt, self.head = ckpt, head

    def _theirs(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        return name.replace(".mlp.", ".feed_forward.")

    def __contains__(self, name: str) -> bool:
        return self._theirs(name) in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        t = self.ckpt.get(self._theirs(name))
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return t.transpose(1, 2)  # ours: outputs first, as a Linear's weight
        return t

    def __getattr__(self, name: str) -> Any:  # the index's other fields (weight_map, paths)
        return getattr(self.ckpt, name)


def checkpoint_view(args: ModelArgs, ckpt: Any) -> Any:
    """``ckpt`` with the checkpoint's names mapped onto the loader's (see the module's docstring)."""
    head = "language_model.lm_head.weight" if args.checkpoint_prefix.startswith("language_model.") else None
    return _Llama4Names(ckpt, head or "lm_head.weight")
