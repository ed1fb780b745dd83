"""One request's life in the engine: its tokens, KV progress, text, stop handling, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .sampler import SamplerState
from .types import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class TokenConstraint(Protocol):
    """Per-choice state of a constrained request (e.g. a JSON-schema grammar)."""

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Bool mask [vocab_size] of the tokens that may come next; never all False."""
        ...

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; True when the constraint is complete."""
        ...


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prefill_seconds: float = 0.0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def decode_tokens_per_s(self) -> float | None:
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "ttft": self.ttft,
            "inter_token_latencies": self.inter_token_latencies,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
        }


@dataclass
class RequestOutput:
    """What a request produced. Streaming yields one per step with the new `delta_*`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    index: int = 0  # which of the `n` choices
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        index: int = 0,
        decoder: Any = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt = list(prompt)
        self.params = params
        self.sampler = SamplerState(params, self.prompt)
        self.output: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.status = WAITING
        self.seq_id: int | None = None
        self.num_computed = 0  # tokens whose K/V is in the cache
        self.order = 0  # admission order; the newest running request is preempted first
        self.fork_from: Request | None = None  # n > 1: siblings fork this request's prompt
        self.constraint: TokenConstraint | None = None  # masks the sampler when set
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(self.prompt))
        # text
        self._decoder = decoder
        self.text = ""
        self._emitted_text = 0
        self._emitted_tokens = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return len(self.prompt) + len(self.output) - self.num_computed

    def append(self, token: int, logprobs: dict[int, float] | None) -> None:
        now = time.perf_counter()
        if self.metrics.first_token is None:
            self.metrics.first_token = now
        self.metrics.token_times.append(now)
        self.output.append(token)
        self.sampler.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self._decoder is not None:
            before = len(self.text)
            self.text += self._decoder.add(token)
            self._check_stop_strings(before)

    def _check_stop_strings(self, before: int) -> None:
        """A stop string may straddle tokens: search from `_hold` chars before the new text."""
        if not self.params.stop:
            return
        start = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]  # the stop string itself is not returned
            self.finish("stop", flush=False)

    def finish(self, reason: str, flush: bool = True) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            if self._decoder is not None and flush:
                self.text += self._decoder.finish()
            self.status = FINISHED

    def take_output(self) -> RequestOutput:
        """The cumulative output plus what is new since the last call."""
        if self.finished:
            visible = len(self.text)
        else:  # hold back what may be the start of a stop string
            visible = max(self._emitted_text, len(self.text) - self._hold)
        out = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            token_ids=list(self.output),
            text=self.text[:visible],
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            index=self.index,
            delta_token_ids=self.output[self._emitted_tokens :],
            delta_text=self.text[self._emitted_text : visible],
            metrics=self.metrics if self.finished else None,
        )
        self._emitted_text, self._emitted_tokens = visible, len(self.output)
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
