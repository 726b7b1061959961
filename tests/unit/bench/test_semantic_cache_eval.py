"""The bundled eval set is well formed and the bench's scoring is right."""

import json

import numpy as np
import pytest

from sidecar.bench.semantic_cache import precision_recall
from sidecar.bench.semantic_pairs import load_pairs


def test_bundled_eval_set_shape():
    pairs = load_pairs(None)
    assert len(pairs) >= 300
    labels = {p["label"] for p in pairs}
    assert labels == {"hit", "miss"}
    assert {p["domain"] for p in pairs} == {
        "tech_support",
        "customer_service",
        "general_knowledge",
        "programming",
    }
    near_miss = {p["category"] for p in pairs if p["label"] == "miss"}
    assert {"number", "negation", "antonym", "entity", "unit", "date", "language"} <= near_miss
    keys = [(p["query"], p["cached"]) for p in pairs]
    assert len(keys) == len(set(keys))
    assert all(p["query"] != p["cached"] for p in pairs)


def test_bad_rows_name_line_and_field(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps({"query": "a", "cached": "b", "label": "hit"})
        + "\n"
        + json.dumps({"query": "a", "cached": "b", "label": "maybe"})
        + "\n"
    )
    with pytest.raises(ValueError, match="line 2: label"):
        load_pairs(str(path))
    path.write_text(json.dumps({"query": "", "cached": "b", "label": "hit"}) + "\n")
    with pytest.raises(ValueError, match="line 1: query"):
        load_pairs(str(path))


def test_precision_recall_counts():
    pred = np.array([True, True, False, False, True])
    truth = np.array([True, False, True, False, True])
    p, r, tp, fp, fn = precision_recall(pred, truth)
    assert (tp, fp, fn) == (2, 1, 1)
    assert p == pytest.approx(2 / 3) and r == pytest.approx(2 / 3)
    assert precision_recall(np.zeros(3, bool), np.array([True, False, True]))[:2] == (1.0, 0.0)
