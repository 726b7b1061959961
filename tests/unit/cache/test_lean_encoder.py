"""The embedder's lean BERT forward: the same vectors as the sentence-transformers path (single texts and
padded batches), the same cache decisions on the bundled paraphrase pairs, and a start-up check that
sends a wrong fast path back to the reference."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sidecar.bench.semantic_pairs import load_pairs
from sidecar.cache import lean_encoder
from sidecar.cache.embedder import Embedder


@pytest.fixture(scope="module")
def emb():
    return Embedder("all-MiniLM-L6-v2", device="cpu")


def _unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_default_embedder_takes_the_lean_forward_and_matches_the_reference(emb):
    assert emb._lean is not None
    texts = [p["query"] for p in load_pairs(None)[:40]]
    for batch in ([texts[0]], texts[:7], texts):  # one text, and padded batches of mixed lengths
        got, ref = _unit(emb.embed(batch)), _unit(emb._reference(batch))
        assert (got * ref).sum(axis=1).min() >= 0.9999


def test_cache_decisions_on_the_paraphrase_pairs_are_unchanged(emb):
    """Each text alone, as a lookup embeds it: the lean and reference similarities differ by less than
    the reference's own bf16 noise (the same pair embedded singly or in a padded batch: up to 1.7e-3)."""
    pairs = load_pairs(None)[:120]

    def sims(embed):
        return np.array([(_unit(embed([p["query"]])) * _unit(embed([p["cached"]]))).sum() for p in pairs])

    lean, ref = sims(emb.embed), sims(emb._reference)
    assert np.abs(lean - ref).max() < 1e-3
    clear = np.abs(ref - 0.95) > 1e-3  # a pair this close to the threshold may go either way in bf16
    assert ((lean >= 0.95) == (ref >= 0.95))[clear].all()
    assert ((ref >= 0.95) & clear).any() and ((ref < 0.95) & clear).any()


def test_a_wrong_fast_path_fails_the_start_up_check(emb, caplog):
    broken = lean_encoder.LeanEncoder.build(emb._model)
    broken.heads = broken.heads // 2  # attention over the wrong head split
    with caplog.at_level(logging.WARNING, logger="sidecar.cache"):
        assert lean_encoder.checked(emb._model, broken, emb._reference) is None
    assert "sentence-transformers path" in caplog.text
    good = lean_encoder.LeanEncoder.build(emb._model)
    assert lean_encoder.checked(emb._model, good, emb._reference) is good


def test_models_it_does_not_handle_keep_the_reference_path(emb, caplog):
    class Other:
        auto_model = object()

    with caplog.at_level(logging.INFO, logger="sidecar.cache"):
        assert lean_encoder.LeanEncoder.build([Other()]) is None
    assert "does not take this model" in caplog.text
    mods = list(emb._model)
    pooling = mods[1]
    saved = pooling.pooling_mode
    try:
        pooling.pooling_mode = "cls"
        assert lean_encoder.LeanEncoder.build(emb._model) is None
    finally:
        pooling.pooling_mode = saved


def test_every_short_length_is_run_once_at_start_and_a_failing_warm_up_is_harmless(emb, caplog):
    seen = []
    lean = emb._lean
    try:
        emb._lean = lambda feats: seen.append(tuple(feats["input_ids"].shape)) or lean(feats)
        emb._warm_shapes()
    finally:
        emb._lean = lean
    assert seen == [(1, n) for n in range(3, 65)]  # [CLS] ... [SEP]: lengths 3 to 64 tokens

    def broken(feats):
        raise RuntimeError("no kernel for this shape")

    emb._lean = broken
    try:
        with caplog.at_level(logging.INFO, logger="sidecar.cache"):
            emb._warm_shapes()
    finally:
        emb._lean = lean
    assert "not prepared at start" in caplog.text
