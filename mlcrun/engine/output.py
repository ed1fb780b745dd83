"""What a request's caller sees: streaming text, stop strings and timings, one OutputStream per
choice. The engine feeds it the tokens a step produced and takes a RequestOutput from it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .request import Request
from .types import RequestMetrics, RequestOutput


class OutputStream:
    """Detokenizes incrementally (never splitting UTF-8: that is the decoder's job), cuts the
    text at the first stop string, which may straddle tokens, and records timings."""

    def __init__(self, req: Request, decoder: Any = None, stream: bool = True) -> None:
        self.streaming = stream  # the caller takes outputs as they come (else the final one)
        self.metrics = RequestMetrics(prompt_tokens=len(req.prompt))
        self.logprobs: list[dict[int, float]] | None = (
            [] if req.params.logprobs is not None else None
        )
        self._stop = req.params.stop
        # Text that may be the start of a stop string is held back while streaming.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._decoder = decoder
        self.text = ""
        self._emitted_text = 0
        self._emitted_tokens = 0

    def add(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[dict[int, float] | None],
        now: float | None = None,
    ) -> bool:
        """Record tokens a step produced (at `now`: the step's time, shared by the tokens of
        one step); True when a stop string ended the text."""
        now = time.perf_counter() if now is None else now
        if self.metrics.first_token is None:
            self.metrics.first_token = now
        self.metrics.token_times.extend([now] * len(tokens))
        if self.logprobs is not None:
            self.logprobs.extend(lp for lp in logprobs if lp is not None)
        if self._decoder is None:
            return False
        before = len(self.text)
        for token in tokens:
            self.text += self._decoder.add(token)
        return self._cut_at_stop(before)

    def _cut_at_stop(self, before: int) -> bool:
        """Search from `_hold` characters before the new text: a stop string may straddle."""
        if not self._stop:
            return False
        start = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]  # the stop string itself is not returned
            self._decoder = None  # nothing after it is shown
        return bool(hits)

    def finish(self) -> None:
        """The request ended: flush what the decoder still holds (an incomplete character)."""
        if self._decoder is not None:
            self.text += self._decoder.finish()
            self._decoder = None

    def take(self, req: Request) -> RequestOutput:
        """The cumulative output plus what is new since the last call."""
        if req.finished:
            visible = len(self.text)
            self.metrics.cached_tokens = req.cached_tokens
            self.metrics.preemptions = req.preemptions
        else:  # hold back what may be the start of a stop string
            visible = max(self._emitted_text, len(self.text) - self._hold)
        output = req.output
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt,
            token_ids=output,
            text=self.text[:visible],
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=req.finish_reason,
            index=req.index,
            delta_token_ids=output[self._emitted_tokens :],
            delta_text=self.text[self._emitted_text : visible],
            metrics=self.metrics if req.finished else None,
            error=req.error,
        )
        self._emitted_text, self._emitted_tokens = visible, len(output)
        return out

    @property
    def has_news(self) -> bool:
        """Whether take() would return new tokens (text may still be held back)."""
        return self._emitted_tokens < len(self.metrics.token_times)
