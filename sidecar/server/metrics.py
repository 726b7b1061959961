"""Prometheus metrics for the sidecar (names prefixed ``sidecar_``).

Request-level histograms are observed by the service as requests finish.
Engine and cache counters are not double-counted here: a custom collector
reads the engine's and the semantic cache's ``stats()`` snapshots at scrape
time, so the numbers always agree with GetStats.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)

StatsFn = Callable[[], dict]
# *_created series double the output and no dashboard of ours reads them.
disable_created_metrics()


class _SnapshotCollector:
    """Turns engine/cache stats() dicts into gauges and counters at scrape time."""

    def __init__(self, engine_stats: StatsFn, cache_stats: Optional[StatsFn]) -> None:
        self._engine_stats = engine_stats
        self._cache_stats = cache_stats

    def describe(self):  # no fixed description: avoids calling stats() at registration
        return []

    def collect(self):
        yield from _engine_metrics(self._engine_stats() or {})
        if self._cache_stats is not None:
            yield from _cache_metrics(self._cache_stats() or {})


def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    g = GaugeMetricFamily(f"sidecar_{name}", doc)
    g.add_metric([], float(value or 0))
    return g


def counter(name: str, doc: str, value) -> CounterMetricFamily:
    c = CounterMetricFamily(f"sidecar_{name}", doc)
    c.add_metric([], float(value or 0))
    return c


def _engine_metrics(s: dict):
    yield gauge("num_requests_running", "Requests in the running batch", s.get("num_running"))
    yield gauge("num_requests_waiting", "Requests waiting to be scheduled", s.get("num_waiting"))
    yield gauge("kv_cache_usage_ratio", "Fraction of KV blocks held by requests", s.get("kv_cache_usage"))
    yield gauge("kv_cache_free_blocks", "KV blocks not held by any request", s.get("num_free_kv_blocks"))
    yield gauge("kv_cache_total_blocks", "KV blocks in the pool", s.get("num_kv_blocks"))
    yield gauge("kv_cache_tokens", "Tokens the KV pool holds (its capacity)", s.get("kv_cache_tokens"))
    yield from _offload_metrics(s)
    yield gauge("kv_cache_bytes", "Bytes of the KV pool (sized once at start)", s.get("kv_cache_bytes"))
    yield counter(
        "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.get("prefix_cache_queries")
    )
    yield counter(
        "prefix_cache_hits", "Prompt tokens served from the prefix cache", s.get("prefix_cache_hits")
    )
    yield counter("preemptions", "Requests preempted for lack of KV blocks", s.get("num_preemptions"))
    yield counter("prompt_tokens", "Prompt tokens processed", s.get("prompt_tokens"))
    yield counter("generation_tokens", "Tokens generated", s.get("generation_tokens"))
    yield counter(
        "engine_requests_finished",
        "Requests the engine finished (stop, length or abort)",
        s.get("num_requests_finished"),
    )
    yield counter(
        "spec_decode_proposed_tokens",
        "Speculative tokens proposed and verified",
        s.get("spec_decode_proposed_tokens"),
    )
    yield counter(
        "spec_decode_accepted_tokens",
        "Speculative tokens accepted by verification",
        s.get("spec_decode_accepted_tokens"),
    )
    paths = s.get("fast_path_active")
    if paths:  # which device fast paths (graphs, kernels, device sampler) the start-up self-check left on
        fp = GaugeMetricFamily(
            "sidecar_fast_path_active", "1 when the device fast path is on", labels=["path"]
        )
        for name, on in sorted(paths.items()):
            fp.add_metric([name], 1.0 if on else 0.0)
        yield fp
    hist = s.get("spec_decode_acceptance_hist")
    if hist:  # hist[a]: verifications that accepted exactly a proposed tokens; buckets are cumulative
        h = HistogramMetricFamily(
            "sidecar_spec_decode_acceptance", "Proposed tokens accepted per speculative verification"
        )
        cum, buckets = 0, []
        for a, n in enumerate(hist):
            cum += n
            buckets.append((str(a), cum))
        buckets.append(("+Inf", cum))
        h.add_metric([], buckets, sum_value=float(sum(a * n for a, n in enumerate(hist))))
        yield h


def _offload_metrics(s: dict):
    for key, doc in (
        ("blocks", "Prefix blocks copied to the offload tiers when they left the pool"),
        ("bytes", "Bytes copied to the offload tiers"),
        ("loaded_blocks", "Offloaded blocks loaded back into the pool"),
        ("loaded_bytes", "Bytes loaded back from the offload tiers"),
        ("host_lookups", "Offload lookups in the host (RAM) tier"),
        ("host_hits", "Offload lookups the host tier answered"),
        ("disk_lookups", "Offload lookups in the disk tier"),
        ("disk_hits", "Offload lookups the disk tier answered"),
        ("disk_corrupt", "Disk-tier files dropped because they failed a check"),
        ("load_time_s", "Seconds spent loading offloaded blocks"),
    ):
        yield counter(f"kv_offload_{key}", doc, s.get(f"kv_offload_{key}"))
    yield gauge(
        "kv_offload_host_hit_rate", "Share of host-tier lookups that hit", s.get("kv_offload_host_hit_rate")
    )
    yield gauge(
        "kv_offload_disk_hit_rate", "Share of disk-tier lookups that hit", s.get("kv_offload_disk_hit_rate")
    )
    yield gauge("kv_offload_disk_enabled", "1 while the disk tier is on", s.get("kv_offload_disk_enabled"))


def _cache_metrics(c: dict):
    yield counter("semantic_cache_lookups", "Semantic cache lookups", c.get("lookups"))
    hits = CounterMetricFamily("sidecar_semantic_cache_hits", "Semantic cache hits", labels=["kind"])
    hits.add_metric(["exact"], float(c.get("exact_hits", 0)))
    hits.add_metric(["semantic"], float(c.get("semantic_hits", 0)))
    yield hits
    yield counter(
        "semantic_cache_guard_rejections",
        "Similar entries refused because numbers/negations/entities differ",
        c.get("guard_rejections"),
    )
    yield counter("semantic_cache_bypasses", "Requests that did not consult the cache", c.get("bypasses"))
    yield counter("semantic_cache_stores", "Answers stored in the cache", c.get("stores"))
    yield gauge("semantic_cache_entries", "Entries in the semantic cache", c.get("entries"))
    yield counter(
        "cache_coalesced", "Requests that followed an identical in-flight generation", c.get("coalesced")
    )
    if "backend_up" in c:  # a shared (Redis) tier is configured
        yield gauge(
            "semantic_cache_backend_up", "1 while the shared cache tier is reachable", c.get("backend_up")
        )
        yield counter(
            "semantic_cache_backend_errors", "Failed calls to the shared cache tier", c.get("backend_errors")
        )
        yield counter(
            "semantic_cache_malformed", "Shared-tier entries skipped as malformed", c.get("malformed")
        )


class Metrics:
    """One registry per service instance (tests run several in one process)."""

    def __init__(self, engine_stats: StatsFn, cache_stats: Optional[StatsFn] = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            "sidecar_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sidecar_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sidecar_e2e_request_latency_seconds",
            "Arrival to completion",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "sidecar_request_queue_time_seconds",
            "Arrival to first scheduling",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "sidecar_request_success", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "sidecar_request_errors", "Requests refused or failed, by status code", ["code"], registry=r
        )
        self.requests = Counter(
            "sidecar_requests", "Requests received, by API and method", ["api", "method"], registry=r
        )
        self.operator_refused = Counter(
            "sidecar_operator_actions_refused",
            "Operator actions refused: a tenant key (reason permission) or an adapter path outside the "
            "--lora-root directories (reason lora_root)",
            ["action", "reason"],
            registry=r,
        )
        r.register(_SnapshotCollector(engine_stats, cache_stats))

    def observe_finished(
        self,
        finish_reason: str,
        queue_s: Optional[float],
        ttft_s: Optional[float],
        e2e_s: Optional[float],
        completion_tokens: int,
    ) -> None:
        self.success.labels(finish_reason=finish_reason or "unknown").inc()
        if queue_s is not None:
            self.queue.observe(queue_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
            if ttft_s is not None and completion_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
