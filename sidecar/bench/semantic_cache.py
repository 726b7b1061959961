"""Semantic cache benchmark: precision/recall on labelled query pairs, lookup latency.

Each pair (query, cached, label) asks: with only ``cached`` stored, should
``query`` be answered from the cache? ``hit`` pairs are paraphrases, ``miss``
pairs are near misses (numbers, negation, antonyms, entities, units, dates,
language, related topics). The decision at the configured threshold is taken
by the real ``SemanticCache`` (one scope per pair); the curve across
thresholds recomputes the same rule (exact form, similarity, guard) offline.

``--grpc`` additionally measures the hit path end to end over gRPC against a
real ``sidecar serve`` subprocess, next to generating the answer (see
``semantic_cache_grpc.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from typing import Optional

import numpy as np

from sidecar.bench.semantic_pairs import latency_summary, load_pairs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pairs",
        default=None,
        help="JSONL eval set; None = the bundled sidecar/bench/data/semantic_pairs.jsonl",
    )
    p.add_argument(
        "--threshold", type=float, default=None, help="similarity threshold; None = the CacheConfig default"
    )
    p.add_argument("--embedding-model", default="all-MiniLM-L6-v2", help="sentence-transformers path or id")
    p.add_argument("--no-guard", action="store_true", help="evaluate without the guard")
    p.add_argument("--latency-lookups", type=int, default=500, help="lookups timed per latency scenario")
    p.add_argument("--out", default="bench-results", help="output directory for JSON and PNG")
    p.add_argument(
        "--grpc", action="store_true", help="also time cache hits end to end over gRPC vs generation"
    )
    p.add_argument("--grpc-requests", type=int, default=200, help="requests per gRPC scenario")
    p.add_argument("--grpc-max-tokens", type=int, default=128, help="tokens generated for the miss baseline")
    p.add_argument("--model", default="demo", help="model served for --grpc")
    from sidecar.bench.semantic_cache_fleet import add_arguments as add_fleet_arguments

    add_fleet_arguments(p)  # --replicas, --backend, --burst: replicas sharing one cache


def _words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.casefold())


def precision_recall(pred: np.ndarray, truth: np.ndarray) -> tuple[float, float, int, int, int]:
    tp = int(np.sum(pred & truth))
    fp = int(np.sum(pred & ~truth))
    fn = int(np.sum(~pred & truth))
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return precision, recall, tp, fp, fn


async def _cache_decisions(cache, pairs: list[dict]) -> list[Optional[object]]:
    """Store each pair's cached query in its own scope and look the query up there."""
    from sidecar.cache.semantic import CacheScope

    hits = []
    for i, row in enumerate(pairs):
        scope = lambda q: CacheScope(tenant=f"pair{i}", model="bench", settings="t=0", context="", query=q)  # noqa: E731
        await cache.store(scope(row["cached"]), "answer", [1], "stop", 1, 1)
        hits.append(await cache.lookup(scope(row["query"])))
    return hits


async def _latency(cache, pairs: list[dict], n: int) -> dict:
    """Lookup latency with every cached query of the set stored in one scope."""
    from sidecar.cache.semantic import CacheScope

    scope = lambda q: CacheScope(tenant="lat", model="bench", settings="t=0", context="", query=q)  # noqa: E731
    for row in pairs:
        await cache.store(scope(row["cached"]), "answer", [1], "stop", 1, 1)
    out = {}
    scenarios = {
        "exact_hit": [r["cached"] for r in pairs],
        # A fresh embedding every time: queries are made unique so the vector memo never answers.
        "semantic_path": [f"{r['query']} ({k})" for k, r in enumerate(pairs)],
    }
    for name, queries in scenarios.items():
        samples = []
        for k in range(n):
            q = queries[k % len(queries)]
            if name == "semantic_path" and k >= len(queries):
                q = f"{q} [{k}]"
            t0 = time.perf_counter()
            await cache.lookup(scope(q))
            samples.append(time.perf_counter() - t0)
        out[name] = latency_summary(samples)
    return out


def _plot(curve: list[dict], threshold: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for key, label in (("guard", "with guard"), ("no_guard", "similarity only")):
        ax.plot(
            [c[key]["recall"] for c in curve], [c[key]["precision"] for c in curve], marker=".", label=label
        )
    at = min(curve, key=lambda c: abs(c["threshold"] - threshold))
    ax.scatter(
        [at["guard"]["recall"]],
        [at["guard"]["precision"]],
        color="red",
        zorder=3,
        label=f"threshold {threshold:.2f}",
    )
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_title("Semantic cache precision/recall across thresholds")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from sidecar.cache import guard
    from sidecar.cache.embedder import Embedder
    from sidecar.cache.semantic import SemanticCache, _exact_form, normalize_query
    from sidecar.config import CacheConfig

    cfg = CacheConfig(
        embedding_model=args.embedding_model,
        guard=not args.no_guard,
        **({"threshold": args.threshold} if args.threshold is not None else {}),
    )
    pairs = load_pairs(args.pairs)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    embedder = Embedder(cfg.embedding_model)
    load_s = time.perf_counter() - t0

    # Offline rule, for the curve: exact form equal, or similarity >= t and the guard agrees.
    q = [normalize_query(r["query"]) for r in pairs]
    c = [normalize_query(r["cached"]) for r in pairs]
    vq, vc = embedder.embed(q), embedder.embed(c)
    sims = np.sum(vq * vc, axis=1)
    exact = np.array([_exact_form(a) == _exact_form(b) for a, b in zip(q, c)])
    reasons = [guard.check(a, b) for a, b in zip(q, c)]
    ok = np.array([r is None for r in reasons])
    truth = np.array([r["label"] == "hit" for r in pairs])
    curve = []
    for t in np.round(np.arange(0.80, 1.0001, 0.005), 3):
        row = {"threshold": float(t)}
        for key, pred in (("guard", exact | ((sims >= t) & ok)), ("no_guard", exact | (sims >= t))):
            p, r, tp, fp, fn = precision_recall(pred, truth)
            row[key] = {"precision": p, "recall": r, "tp": tp, "fp": fp, "fn": fn}
        curve.append(row)

    # The decision at the configured threshold, taken by the real cache.
    cache = SemanticCache(cfg, embedder=embedder)
    hits = asyncio.run(_cache_decisions(cache, pairs))
    pred = np.array([h is not None for h in hits])
    precision, recall, tp, fp, fn = precision_recall(pred, truth)
    cache.close()
    by_category: dict[str, dict] = {}
    for row, h in zip(pairs, pred):
        d = by_category.setdefault(row["category"], {"pairs": 0, "served": 0})
        d["pairs"] += 1
        d["served"] += int(h)
    # Recall by how much wording the paraphrase shares with the stored question (word Jaccard):
    # light rewording is easy for any cache, restructured questions are the real test.
    overlap_bins: dict[str, dict] = {}
    for row, h in zip(pairs, pred):
        if row["label"] != "hit":
            continue
        a, b = set(_words(row["query"])), set(_words(row["cached"]))
        j = len(a & b) / max(1, len(a | b))
        name = "overlap>=0.7" if j >= 0.7 else ("overlap 0.4-0.7" if j >= 0.4 else "overlap<0.4")
        d = overlap_bins.setdefault(name, {"pairs": 0, "served": 0})
        d["pairs"] += 1
        d["served"] += int(h)
    for d in overlap_bins.values():
        d["recall"] = d["served"] / d["pairs"]
    false_hits = [
        {"query": r["query"], "cached": r["cached"], "category": r["category"], "similarity": float(s)}
        for r, h, s in zip(pairs, pred, sims)
        if h and r["label"] == "miss"
    ]
    refused = {}
    for r, why, s in zip(pairs, reasons, sims):
        if why is not None and s >= cfg.threshold:
            refused.setdefault(f"{r['label']}:{why}", 0)
            refused[f"{r['label']}:{why}"] += 1

    lat_cache = SemanticCache(
        CacheConfig(embedding_model=cfg.embedding_model, threshold=cfg.threshold, guard=cfg.guard),
        embedder=embedder,
    )
    latency = asyncio.run(_latency(lat_cache, pairs, args.latency_lookups))
    lat_cache.close()

    result = {
        "pairs": len(pairs),
        "positives": int(truth.sum()),
        "negatives": int((~truth).sum()),
        "embedding_model": cfg.embedding_model,
        "embedder_load_s": load_s,
        "threshold": cfg.threshold,
        "guard": cfg.guard,
        "at_threshold": {"precision": precision, "recall": recall, "tp": tp, "fp": fp, "fn": fn},
        "served_by_category": by_category,
        "recall_by_word_overlap": overlap_bins,
        "false_hits": false_hits,
        "guard_refusals_above_threshold": refused,
        "curve": curve,
        "lookup_latency": latency,
    }
    if args.grpc:
        from sidecar.bench.semantic_cache_grpc import measure_grpc

        result["grpc"] = measure_grpc(args)
    from sidecar.bench import semantic_cache_fleet

    if semantic_cache_fleet.wanted(args):
        result["fleet"] = semantic_cache_fleet.measure_fleet(args)
    _plot(curve, cfg.threshold, os.path.join(args.out, "semantic_cache_pr.png"))
    with open(os.path.join(args.out, "semantic_cache.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, ensure_ascii=False)

    print(f"pairs: {len(pairs)} ({int(truth.sum())} should hit, {int((~truth).sum())} must miss)")
    print(
        f"threshold {cfg.threshold:.3f} guard={'on' if cfg.guard else 'off'}: precision {precision:.4f}"
        f"  recall {recall:.4f}  (tp {tp}, fp {fp}, fn {fn})"
    )
    for name, d in sorted(overlap_bins.items()):
        print(f"  recall {name}: {d['recall']:.3f} ({d['served']}/{d['pairs']})")
    for row in false_hits:
        print(
            f"  false hit [{row['category']}] sim={row['similarity']:.3f}: {row['query']!r} -> {row['cached']!r}"
        )
    for name, v in latency.items():
        print(f"lookup {name}: p50 {v['p50_ms']:.2f} ms  p99 {v['p99_ms']:.2f} ms  (n={v['n']})")
    if "grpc" in result:
        for name, v in result["grpc"].items():
            if isinstance(v, dict) and "p50_ms" in v:
                print(f"grpc {name}: p50 {v['p50_ms']:.2f} ms  p99 {v['p99_ms']:.2f} ms  (n={v['n']})")
    fleet = result.get("fleet")
    if fleet:
        print(
            f"fleet ({fleet['replicas']} replicas, {fleet['backend']}): visible at once "
            f"{fleet['visible_at_once']:.2f}"
        )
        if "cross_replica_hit_after_store" in fleet:
            v = fleet["cross_replica_hit_after_store"]
            print(
                f"  cross-replica hit after store: p50 {v['p50_ms']:.1f} ms  p99 {v['p99_ms']:.1f} ms  (n={v['n']})"
            )
        for b in fleet["bursts"]:
            print(
                f"  burst of {b['requests']}: {b['generations']:.0f} generation(s), {b['coalesced']:.0f} coalesced, "
                f"{b['cache_hits']} cache hits, {b['distinct_answers']} distinct answer(s), {b['wall_s']:.2f} s"
            )
    print(f"wrote {os.path.join(args.out, 'semantic_cache.json')} and semantic_cache_pr.png")
    return 0
