"""A request's timings as a benchmark records them, and their summaries.

Definitions follow vLLM's `benchmark_serving` so numbers compare across tools:

* TTFT: from sending the request to receiving its first output token.
* E2EL: from sending the request to receiving its last output token.
* TPOT (per request, requests with > 1 output token): (E2EL - TTFT) / (output tokens - 1).
* ITL: the gaps between consecutive streamed chunks of a request, pooled over all requests
  (a chunk that carries several tokens counts once, as vLLM does).
* Throughputs: completed requests, input tokens, output tokens, over the benchmark's wall time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

STAT_KEYS = ("mean", "std", "median", "p90", "p99", "min", "max")
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    *LATENCY_KEYS,
    "prefix_cache_hit_rate",
)


@dataclass
class RequestRecord:
    """What one request did, in seconds on one clock (time.perf_counter)."""

    index: int
    prompt_len: int
    start: float  # request sent / submitted
    chunk_times: list[float] = field(default_factory=list)  # each streamed chunk's arrival
    output_len: int = 0  # output tokens received
    end: float | None = None  # last token / completion received
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (when known)
    error: str | None = None  # set when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        """Seconds to the first chunk; None when no chunk arrived."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        """Seconds from sending to the end; None when the request never ended."""
        return self.end - self.start if self.end is not None else None

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive chunks."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than 2 output tokens."""
        ttft, e2el = self.ttft, self.e2el
        if self.output_len < 2 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (self.output_len - 1)


def stats(values: Sequence[float]) -> dict:
    """Mean, population std, median, p90, p99, min and max (np.percentile, linear
    interpolation); all None for no values."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return dict.fromkeys(STAT_KEYS)
    median, p90, p99 = np.percentile(data, [50, 90, 99])
    numbers = (data.mean(), data.std(), median, p90, p99, data.min(), data.max())
    return {key: float(value) for key, value in zip(STAT_KEYS, numbers)}


def _ms_stats(seconds: list[float | None]) -> dict:
    return stats([s * 1000.0 for s in seconds if s is not None])


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """The benchmark's summary: counts, throughputs per second of `duration` (None when it is
    not positive) and latency stats in milliseconds, over completed requests only."""
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)

    def per_s(count: int) -> float | None:
        return count / duration if duration > 0 else None

    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": float(duration),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": _ms_stats([r.ttft for r in done]),
        "tpot_ms": _ms_stats([r.tpot for r in done]),
        "itl_ms": _ms_stats([gap for r in done for gap in r.itl]),
        "e2el_ms": _ms_stats([r.e2el for r in done]),
        "prefix_cache_hit_rate": cached_tokens / input_tokens if input_tokens else None,
    }


def record_dict(r: RequestRecord) -> dict:
    """One request's raw sample for the JSON report (seconds, relative to its start)."""
    return {
        "index": r.index,
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "cached_tokens": r.cached_tokens,
        "error": r.error,
        "ttft_s": r.ttft,
        "e2el_s": r.e2el,
        "itl_s": r.itl,
    }
