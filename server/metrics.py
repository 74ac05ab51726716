"""Prometheus metrics for ``GET /metrics``.

Why a registry per app (not the global default): tests and embedders may build several apps in
one process, and prometheus_client refuses to register the same metric name twice. The figures
come from the same ``GenerationStats`` that ``usage`` reports, so /metrics, usage and bench agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.api import GenerationStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mtpserve_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "mtpserve_request_duration_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "mtpserve_time_to_first_token_seconds",
            "Time from arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "mtpserve_queue_wait_seconds",
            "Time a generation waited for the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mtpserve_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "mtpserve_generation_tokens", "Tokens generated", registry=r
        )
        self.draft_proposed = Counter(
            "mtpserve_spec_draft_tokens_proposed", "MTP draft tokens proposed", registry=r
        )
        self.draft_accepted = Counter(
            "mtpserve_spec_draft_tokens_accepted", "MTP draft tokens accepted", registry=r
        )
        self.cycles = Counter("mtpserve_spec_cycles", "Decode cycles run", registry=r)
        self.cycles_by_k = Counter(
            "mtpserve_spec_cycles_by_draft_tokens",
            "Decode cycles run with each draft length K (auto K picks it per cycle)",
            ["k"],
            registry=r,
        )
        self.draft_tokens_in_use = Gauge(
            "mtpserve_spec_draft_tokens_mean",
            "Mean draft length K per cycle of the last finished generation",
            registry=r,
        )
        self.generations = Counter(
            "mtpserve_generations", "Finished generations by outcome", ["outcome"], registry=r
        )
        self.queue_depth = Gauge(
            "mtpserve_queue_depth", "Generations waiting for the engine", registry=r
        )
        self.running = Gauge(
            "mtpserve_running", "Generations running on the engine (rows of the batch)", registry=r
        )
        self.acceptance_rate = Gauge(
            "mtpserve_spec_acceptance_rate",
            "Accepted / proposed draft tokens since start",
            registry=r,
        )

    def bind_scheduler(self, depth: Callable[[], int], running: Callable[[], int]) -> None:
        """Make the gauges read live values at scrape time."""
        self.queue_depth.set_function(depth)
        self.running.set_function(running)

    def record_stats(self, stats: GenerationStats | None) -> None:
        """Add one finished generation's engine figures (called from the worker thread)."""
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.draft_proposed.inc(stats.proposed)
        self.draft_accepted.inc(stats.accepted)
        self.cycles.inc(stats.cycles)
        for k, n in enumerate(stats.k_histogram):
            if n:
                self.cycles_by_k.labels(k=str(k)).inc(n)
        if stats.cycles:
            mean_k = sum(k * n for k, n in enumerate(stats.k_histogram)) / stats.cycles
            self.draft_tokens_in_use.set(mean_k)
        proposed = self.draft_proposed._value.get()
        accepted = self.draft_accepted._value.get()
        self.acceptance_rate.set(accepted / proposed if proposed else 0.0)

    def bind_prompt_cache(self, describe: Callable[[], dict[str, Any] | None]) -> None:
        """Expose the engine's conversation-cache counters (read at scrape time)."""
        self.registry.register(_PromptCacheCollector(describe))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector(Collector):
    """The engine's prefix-cache figures (``PrefixCache.describe()``) as Prometheus samples."""

    _COUNTERS = (
        ("lookups", "Prompt-cache lookups (one per generation)"),
        ("hits", "Lookups that restored a cached prefix"),
        ("reused_tokens", "Prompt tokens restored from the cache instead of prefilled"),
        ("evictions", "Snapshots evicted to stay within the byte budget"),
        ("errors", "Prompt-cache faults (a full disk, ...): logged, the request went on"),
    )

    def __init__(self, figures: Callable[[], dict[str, Any] | None]) -> None:
        self._figures = figures  # not ``describe``: the registry would call that

    def collect(self) -> Iterator[Any]:
        figures = self._figures() or {}
        for name, doc in self._COUNTERS:
            family = CounterMetricFamily(f"mtpserve_prompt_cache_{name}", doc)
            family.add_metric([], figures.get(name, 0))
            yield family
        held = GaugeMetricFamily("mtpserve_prompt_cache_bytes", "Bytes the prompt cache holds")
        held.add_metric([], figures.get("bytes_held", 0))
        yield held
        snaps = GaugeMetricFamily(
            "mtpserve_prompt_cache_snapshots", "Snapshots held in memory by the prompt cache"
        )
        snaps.add_metric([], figures.get("snapshots", 0))
        yield snaps
