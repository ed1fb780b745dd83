"""Prometheus text exposition for the server: request and token counters, latency histograms,
and gauges read from the engine (running/waiting, KV pages, sequences per step).

Everything here is updated from the event loop thread only; the engine's numbers come from a
snapshot (`AsyncEngine.stats()`), so no locking is needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from ..engine.engine import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX = "mlcrun"


class Histogram:
    def __init__(self, name: str, help: str, buckets: Iterable[float]) -> None:
        self.name, self.help = f"{PREFIX}_{name}", help
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {total}')
        out += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {total}"]
        return out


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.requests: dict[tuple[str, str, int], int] = {}  # (method, path, status) -> count
        self.finished: dict[str, int] = {}  # finish_reason -> choices
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = Histogram("inter_token_latency_seconds", "Time between tokens.", LATENCY_BUCKETS)
        self.e2e = Histogram(
            "request_latency_seconds", "Generation request latency.", LATENCY_BUCKETS
        )
        self.in_flight = 0
        self.rejected = 0  # queue full or shutting down

    def count_request(self, method: str, path: str, status: int) -> None:
        key = (method, path, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def record_choice(self, finish_reason: str | None, metrics) -> None:
        """A finished choice: its finish reason, latencies and tokens."""
        reason = finish_reason or "unknown"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.token_times:
            self.e2e.observe(metrics.token_times[-1] - metrics.arrival)
        self.generation_tokens += len(metrics.token_times)

    def record_aborted(self, choices: int, tokens: int) -> None:
        if choices:
            self.finished["abort"] = self.finished.get("abort", 0) + choices
        self.generation_tokens += tokens

    def record_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def render(self, stats: EngineStats) -> str:
        lines: list[str] = []
        counter = _family(lines, "counter")
        gauge = _family(lines, "gauge")
        counter(
            "http_requests_total",
            "HTTP requests by method, path and status.",
            {f'method="{m}",path="{p}",status="{s}"': n for (m, p, s), n in self.requests.items()},
        )
        counter(
            "request_success_total",
            "Finished choices by finish reason.",
            {f'finish_reason="{r}"': n for r, n in self.finished.items()},
        )
        counter("prompt_tokens_total", "Prompt tokens of generation requests.", self.prompt_tokens)
        counter(
            "prompt_tokens_cached_total",
            "Prompt tokens reused from the prefix cache.",
            self.cached_tokens,
        )
        counter("generation_tokens_total", "Generated tokens.", self.generation_tokens)
        counter(
            "requests_rejected_total", "Requests refused: queue full or draining.", self.rejected
        )
        lines += self.ttft.lines() + self.itl.lines() + self.e2e.lines()
        gauge("requests_in_flight", "Generation requests the server is handling.", self.in_flight)
        gauge("num_requests_running", "Sequences in the running batch.", stats.running)
        gauge("num_requests_waiting", "Sequences waiting for admission.", stats.waiting)
        used = stats.total_pages - stats.free_pages
        gauge("kv_pages_total", "KV cache pages.", stats.total_pages)
        gauge("kv_pages_used", "KV cache pages in use (requests and prefix cache).", used)
        gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV pages in use.",
            used / stats.total_pages if stats.total_pages else 0.0,
        )
        gauge(
            "prefix_cache_sequences",
            "Finished sequences kept for prefix reuse.",
            stats.cached_sequences,
        )
        counter("preemptions_total", "Requests preempted for KV space.", stats.preemptions)
        counter("engine_prefill_tokens_total", "Tokens prefilled.", stats.prefill_tokens)
        counter("engine_decode_tokens_total", "Tokens decoded.", stats.decode_tokens)
        lines += _step_histogram(stats.step_sizes).lines()
        return "\n".join(lines) + "\n"


def _family(lines: list[str], kind: str):
    def add(name: str, help: str, value: float | Mapping[str, float]) -> None:
        full = f"{PREFIX}_{name}"
        lines.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}"])
        if isinstance(value, Mapping):
            lines.extend(f"{full}{{{labels}}} {_num(v)}" for labels, v in value.items())
        else:
            lines.append(f"{full} {_num(value)}")

    return add


def _step_histogram(step_sizes: Mapping[int, int]) -> Histogram:
    """Sequences per engine step (decode + prefill): > 1 means requests were batched."""
    hist = Histogram("batch_size", "Sequences per engine step.", BATCH_BUCKETS)
    for size, steps in sorted(step_sizes.items()):
        if size > 0:  # steps where nothing progressed (waiting for KV pages) are not batches
            hist.observe(size, steps)
    return hist


def _num(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))
