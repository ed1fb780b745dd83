"""Prometheus metrics for the server, with prometheus_client: request and token counters,
latency histograms, and gauges read from the engine (running/waiting, KV pages, sequences per
step).

Every label has a fixed set of values (HTTP methods outside the standard ones and unknown
paths are "other"), so no client can make the output grow. Counters and histograms the server
updates as requests end are prometheus_client objects in a per-server registry; numbers kept
elsewhere (the engine's stats snapshot, and the in-flight/rejected/cached counts the service
keeps as plain ints) are read by a collector when /metrics is scraped.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from ..engine.engine import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX = "mlcrun"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4

METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))
FINISH_REASONS = frozenset(("stop", "length", "abort", "error"))

# `_created` series (one timestamp per counter and label set) would double the output for
# nothing a dashboard uses; the switch is process-wide, and mlcrun has no other registry.
prometheus_client.disable_created_metrics()


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()  # per server, not the process-wide default
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by method, path and status.",
            ("method", "path", "status"),
            registry=reg,
        )
        self.finished = Counter(
            f"{PREFIX}_request_success",
            "Finished choices by finish reason.",
            ("finish_reason",),
            registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of generation requests.", registry=reg
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", registry=reg
        )
        self.ttft = _latency(reg, "time_to_first_token_seconds", "Time to first token.")
        self.itl = _latency(reg, "inter_token_latency_seconds", "Time between tokens.")
        self.e2e = _latency(reg, "request_latency_seconds", "Generation request latency.")
        # Plain ints: the service updates them directly (admission, tickets, prefix hits).
        self.cached_tokens = 0
        self.in_flight = 0
        self.rejected = 0  # queue full or shutting down
        self._stats: EngineStats | None = None
        reg.register(_Snapshot(self))

    def count_request(self, method: str, path: str, status: int) -> None:
        """`path` must already be bounded (the app's route templates)."""
        method = method if method in METHODS else "other"
        self.requests.labels(method, path, str(status)).inc()

    def record_choice(self, finish_reason: str | None, metrics) -> None:
        """A finished choice: its finish reason, latencies and tokens."""
        self._finish(finish_reason)
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.token_times:
            self.e2e.observe(metrics.token_times[-1] - metrics.arrival)
        self.generation_tokens.inc(len(metrics.token_times))

    def record_aborted(self, choices: int, tokens: int) -> None:
        if choices:
            self._finish("abort", choices)
        self.generation_tokens.inc(tokens)

    def record_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens += cached_tokens

    def _finish(self, reason: str | None, times: int = 1) -> None:
        label = "unknown" if reason is None else reason if reason in FINISH_REASONS else "other"
        self.finished.labels(label).inc(times)

    def render(self, stats: EngineStats) -> str:
        """The text exposition, with the engine numbers of `stats` (a snapshot)."""
        self._stats = stats
        try:
            return generate_latest(self.registry).decode()
        finally:
            self._stats = None


def _latency(registry: CollectorRegistry, name: str, help: str) -> Histogram:
    return Histogram(f"{PREFIX}_{name}", help, buckets=LATENCY_BUCKETS, registry=registry)


class _Snapshot:
    """What is read at scrape time: the service's counts and the engine's stats snapshot."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield _counter(
            "prompt_tokens_cached", "Prompt tokens reused from the prefix cache.", m.cached_tokens
        )
        yield _counter("requests_rejected", "Requests refused: queue full or draining.", m.rejected)
        yield _gauge(
            "requests_in_flight", "Generation requests the server is handling.", m.in_flight
        )
        if m._stats is not None:  # None only when registry.collect() runs outside render()
            yield from _engine(m._stats)


def _engine(stats: EngineStats) -> Iterator[Metric]:
    yield _gauge("num_requests_running", "Sequences in the running batch.", stats.running)
    yield _gauge("num_requests_waiting", "Sequences waiting for admission.", stats.waiting)
    used = stats.total_pages - stats.free_pages
    yield _gauge("kv_pages_total", "KV cache pages.", stats.total_pages)
    yield _gauge("kv_pages_used", "KV cache pages in use (requests and prefix cache).", used)
    ratio = used / stats.total_pages if stats.total_pages else 0.0
    yield _gauge("kv_cache_usage_ratio", "Fraction of KV pages in use.", ratio)
    yield _gauge(
        "prefix_cache_sequences",
        "Finished sequences kept for prefix reuse.",
        stats.cached_sequences,
    )
    yield _counter("preemptions", "Requests preempted for KV space.", stats.preemptions)
    yield _counter("engine_prefill_tokens", "Tokens prefilled.", stats.prefill_tokens)
    yield _counter("engine_decode_tokens", "Tokens decoded.", stats.decode_tokens)
    yield _counter(
        "spec_draft_steps", "Request steps that drafted (speculative decoding).", stats.spec_steps
    )
    yield _counter("spec_draft_tokens", "Tokens drafted.", stats.spec_drafted)
    yield _counter(
        "spec_accepted_tokens", "Drafted tokens the model accepted.", stats.spec_accepted
    )
    yield _counter("spec_draft_seconds", "Seconds spent drafting.", stats.draft_seconds)
    yield _counter("spec_verify_seconds", "Seconds spent verifying drafts.", stats.verify_seconds)
    yield _step_histogram(stats.step_sizes)


def _counter(name: str, help: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", help, value=value)  # exposed as name_total


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help, value=value)


def _step_histogram(step_sizes: Mapping[int, int]) -> HistogramMetricFamily:
    """Sequences per engine step (decode + prefill): > 1 means requests were batched. The
    bounds are written as integers (le="8", not "8.0"): dashboards and tests name them so."""
    counts = [0] * (len(BATCH_BUCKETS) + 1)  # the last one is +Inf
    total = 0
    for size, steps in step_sizes.items():
        if size > 0:  # steps where nothing progressed (waiting for KV pages) are not batches
            counts[bisect.bisect_left(BATCH_BUCKETS, size)] += steps
            total += size * steps
    cumulative, buckets = 0, []
    for bound, count in zip((*map(str, BATCH_BUCKETS), "+Inf"), counts):
        cumulative += count
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(
        f"{PREFIX}_batch_size", "Sequences per engine step.", buckets=buckets, sum_value=total
    )
