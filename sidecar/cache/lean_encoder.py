"""A lean forward pass for BERT-family sentence embedders with mean pooling (all-MiniLM-L6-v2).

A semantic-cache hit costs one embedding of a short query, and on CPU a 16-token query through
transformers' ``BertModel`` spends much of its time outside the matrix products: per-layer module
dispatch, output capturing, signature inspection, three separate Q/K/V projections. This runs the same
weights (the modules themselves, not copies, except one fused Q/K/V weight per layer) with one Q/K/V
product per layer and no bookkeeping (what it saves: docs/perf/code-notes.md). Mean pooling is done in
float32.

``LeanEncoder.build(st_model)`` returns None when the model is not of the shape this handles (another
architecture, pooling mode, position embedding or activation); the embedder then keeps the
sentence-transformers path, which is also the oracle the start-up check holds this to.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger("sidecar.cache")

# Start-up check: the cosine of each lean vector with the reference path's on probe sentences. The two
# differ by bf16 rounding order only, which stays well above this bound, while a real fault (a padding mask
# left out of a batch) falls well below it (figures: docs/perf/code-notes.md).
_CHECK_MIN_COSINE = 0.9999
_PROBES = [
    "How do I reset my password?",
    "What are the steps to reset my password on a Linux machine with sudo?",
    "hi",
    "Ceci n'est pas une pipe.",
]


class LeanEncoder:
    def __init__(self, bert: Any) -> None:
        self.embeddings = bert.embeddings
        self.heads = int(bert.config.num_attention_heads)
        self.layers = []
        for layer in bert.encoder.layer:
            a = layer.attention.self
            wqkv = torch.cat([a.query.weight, a.key.weight, a.value.weight]).detach().contiguous()
            bqkv = torch.cat([a.query.bias, a.key.bias, a.value.bias]).detach().contiguous()
            self.layers.append(
                (
                    wqkv,
                    bqkv,
                    layer.attention.output.dense,
                    layer.attention.output.LayerNorm,
                    layer.intermediate.dense,
                    layer.output.dense,
                    layer.output.LayerNorm,
                )
            )

    @classmethod
    def build(cls, st_model: Any) -> Optional["LeanEncoder"]:
        """The lean forward for this SentenceTransformer, or None (with the reason logged) when its modules
        are not a BertModel with absolute positions and GELU followed by mean pooling (and normalisation)."""
        mods = list(st_model)
        bert = getattr(mods[0], "auto_model", None) if mods else None
        cfg = getattr(bert, "config", None)
        names = [type(m).__name__ for m in mods]
        pooling = mods[1] if len(mods) > 1 else None
        why = None
        if type(bert).__name__ != "BertModel" or cfg is None:
            why = f"encoder {type(bert).__name__}"
        elif names[1:] not in (["Pooling"], ["Pooling", "Normalize"]):
            why = f"modules {names}"
        elif not _mean_pooling(pooling):
            why = "pooling other than the mean of all tokens"
        elif getattr(cfg, "position_embedding_type", "absolute") != "absolute" or cfg.hidden_act != "gelu":
            why = f"position embedding {getattr(cfg, 'position_embedding_type', '?')}, activation {cfg.hidden_act}"
        if why is not None:
            log.info("semantic cache embedder: the lean forward does not take this model (%s)", why)
            return None
        return cls(bert)

    def __call__(self, features: dict) -> torch.Tensor:
        """Unit-norm float32 sentence vectors [B, dim] for tokenized ``features`` (input_ids, attention_mask,
        optional token_type_ids), as the SentenceTransformer's mean pooling and normalisation give them."""
        ids, mask = features["input_ids"], features["attention_mask"]
        x = self.embeddings(input_ids=ids, token_type_ids=features.get("token_type_ids"))
        b, t, d = x.shape
        keys = None if bool(mask.all()) else mask[:, None, None, :].bool()  # padding keys masked out
        hd = d // self.heads
        for wqkv, bqkv, out, ln1, up, down, ln2 in self.layers:
            qkv = F.linear(x, wqkv, bqkv).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keys)
            x = ln1(out(o.transpose(1, 2).reshape(b, t, d)) + x)
            x = ln2(down(F.gelu(up(x))) + x)
        m = mask[..., None].to(torch.float32)
        pooled = (x.float() * m).sum(1) / m.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, p=2, dim=1)


def _mean_pooling(pooling: Any) -> bool:
    """Mean over every token (prompt included): ``pooling_mode == "mean"``, or the older boolean flags."""
    if getattr(pooling, "include_prompt", True) is False:
        return False
    mode = getattr(pooling, "pooling_mode", None)
    if isinstance(mode, str):
        return mode == "mean"
    flags = [k for k, v in vars(pooling).items() if k.startswith("pooling_mode_") and v is True]
    return flags == ["pooling_mode_mean_tokens"]


def checked(st_model: Any, lean: Optional[LeanEncoder], reference) -> Optional[LeanEncoder]:
    """``lean`` if its vectors match ``reference(texts)`` (the sentence-transformers path, unit-norm numpy
    rows) on the probe sentences, one at a time and as a padded batch; else None, with the reason logged."""
    if lean is None:
        return None
    prepare = getattr(st_model, "preprocess", None) or st_model.tokenize
    try:
        with torch.inference_mode():
            for texts in [[p] for p in _PROBES] + [_PROBES]:
                feats = {
                    k: v.to(st_model.device) if isinstance(v, torch.Tensor) else v
                    for k, v in prepare(texts).items()
                }
                got = lean(feats).double().cpu().numpy()
                ref = np.asarray(reference(texts), dtype=np.float64)
                ref /= np.maximum(np.linalg.norm(ref, axis=1, keepdims=True), 1e-12)
                worst = float((got * ref).sum(axis=1).min())
                if not worst >= _CHECK_MIN_COSINE:
                    log.warning(
                        "semantic cache embedder: lean forward agrees to cosine %.5f on %d text(s); "
                        "using the sentence-transformers path",
                        worst,
                        len(texts),
                    )
                    return None
    except Exception as exc:  # any failure of the fast path costs speed, never an answer
        log.warning(
            "semantic cache embedder: lean forward failed its check (%s); using the "
            "sentence-transformers path",
            exc,
        )
        return None
    return lean
