"""The semantic-cache evaluation set and the latency summary both semantic-cache benchmarks report.

Shared by the offline benchmark (``semantic_cache.py``) and the end-to-end gRPC
one (``semantic_cache_grpc.py``), which otherwise do not import each other.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Optional

import numpy as np


def load_pairs(path: Optional[str]) -> list[dict]:
    """The labelled pairs at ``path`` (JSONL), or the bundled set; raises ValueError naming a bad line."""
    if path is None:
        text = (
            resources.files("sidecar.bench").joinpath("data/semantic_pairs.jsonl").read_text(encoding="utf-8")
        )
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for field in ("query", "cached", "label"):
            if not isinstance(row.get(field), str) or not row[field]:
                raise ValueError(f"pairs line {n}: {field}: must be a non-empty string")
        if row["label"] not in ("hit", "miss"):
            raise ValueError(f"pairs line {n}: label: must be hit or miss, got {row['label']!r}")
        pairs.append(row)
    return pairs


def latency_summary(samples_s: list[float]) -> dict:
    """p50/p99/mean in milliseconds of latencies given in seconds."""
    ms = np.asarray(samples_s) * 1000.0
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "n": int(ms.size),
    }
