"""Engine data types: what a request asks for and what it gets back."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Protocol

import numpy as np

from ..errors import MlcrunError

# Sane ranges, checked at the door. Beyond them the numbers stop meaning anything (a
# temperature of 100 is already uniform sampling) and float32 logits overflow.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; validated (and normalised) at construction."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) means no top-k cut
    seed: int | None = None
    logprobs: int | None = None  # return the top-N logprobs of each generated position
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # New fields go below, so that positional construction keeps working.
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top probability
    # HF/vLLM semantics, over prompt + generated tokens: positive logits divided, negative
    # multiplied.
    repetition_penalty: float = 1.0
    # OpenAI semantics, over generated tokens only: logit -= freq * count + presence * (count > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id -> bias added to its logit before anything else. Give a dict (or pairs); it is
    # stored as sorted (token_id, bias) pairs so that the dataclass stays frozen and hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (applied by the detokenizer)
    n: int = 1  # completions per prompt
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are generated

    def __post_init__(self) -> None:
        set_ = partial(object.__setattr__, self)
        set_("max_tokens", _int("max_tokens", self.max_tokens, lo=1))
        set_("temperature", _float("temperature", self.temperature, lo=0.0, hi=MAX_TEMPERATURE))
        top_p = _float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise MlcrunError(f"top_p must be in (0, 1], got {self.top_p!r}")
        set_("top_p", top_p)
        top_k = -1 if self.top_k == -1 else _int("top_k", self.top_k, lo=0, hi=MAX_TOP_K, off=-1)
        set_("top_k", max(top_k, 0))
        set_("min_p", _float("min_p", self.min_p, lo=0.0, hi=1.0))
        if self.seed is not None:
            set_("seed", _int("seed", self.seed))
        if self.logprobs is not None:
            set_("logprobs", _int("logprobs", self.logprobs, lo=0, hi=20))
        if not isinstance(self.ignore_eos, bool):
            raise MlcrunError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        set_("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        lo, hi = REPETITION_PENALTY_RANGE
        set_(
            "repetition_penalty",
            _float("repetition_penalty", self.repetition_penalty, lo=lo, hi=hi),
        )
        for name in ("frequency_penalty", "presence_penalty"):
            set_(name, _float(name, getattr(self, name), lo=-2.0, hi=2.0))
        set_("logit_bias", _logit_bias(self.logit_bias))
        set_("stop", _stop_strings(self.stop))
        set_("n", _int("n", self.n, lo=1))
        set_("min_tokens", _int("min_tokens", self.min_tokens, lo=0))
        if self.min_tokens > self.max_tokens:
            raise MlcrunError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """From a plain mapping (JSON, generation defaults); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise MlcrunError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; "
                f"known ones are {', '.join(sorted(known))}"
            )
        return cls(**d)


def _int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None, off=None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise MlcrunError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if lo is not None and hi is not None else None
        bound = bound or (f">= {lo}" if lo is not None else f"<= {hi}")
        also = f" (or {off} for off)" if off is not None else ""
        raise MlcrunError(f"{name} must be {bound}{also}, got {value!r}")
    return int(value)


def _float(name: str, value: Any, *, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise MlcrunError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise MlcrunError(f"{name} must be finite, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f"in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else None
        bound = bound or (f">= {lo:g}" if lo is not None else f"<= {hi:g}")
        raise MlcrunError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def _token_id(name: str, value: Any) -> int:
    # JSON object keys are strings; isdigit() alone also accepts "²", which int() refuses.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise MlcrunError(f"{name}: token ids must be non-negative integers, got {value!r}")
    return int(value)


def _token_ids(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise MlcrunError(f"{name} must be a list of token ids, got {values!r}")
    return tuple(_token_id(name, v) for v in values)


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    try:
        pairs = list(bias.items()) if isinstance(bias, Mapping) else [tuple(p) for p in bias]
    except TypeError:
        raise MlcrunError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise MlcrunError(f"logit_bias must map token ids to numbers, got {bias!r}")
        token = _token_id("logit_bias", pair[0])
        if token in out:
            raise MlcrunError(f"logit_bias names token {token} twice")
        out[token] = _float(f"logit_bias[{token}]", pair[1], lo=-100.0, hi=100.0)
    return tuple(sorted(out.items()))


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stop = (stop,) if isinstance(stop, str) else stop
    stop = tuple(stop) if isinstance(stop, Iterable) and not isinstance(stop, Mapping) else None
    if stop is None or not all(isinstance(s, str) and s for s in stop):
        raise MlcrunError("stop must be a string or a list of non-empty strings")
    return stop


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
    # Speculative decoding: steps in which this request drafted, tokens drafted, accepted.
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        """One per token after the first. Tokens that one step produced together (accepted
        drafts) share that step's wait evenly, so these sum to the decode time and average
        to the time per output token."""
        t, out = self.token_times, []
        i = 1
        while i < len(t):
            j = i
            while j + 1 < len(t) and t[j + 1] == t[i]:
                j += 1
            out += [(t[i] - t[i - 1]) / (j - i + 1)] * (j - i + 1)
            i = j + 1
        return out

    @property
    def acceptance_rate(self) -> float | None:
        """Drafted tokens the target kept."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per speculative step: accepted drafts plus the target's own token."""
        return (
            (self.accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else None
        )

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
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class RequestOutput:
    """What a request produced. Streaming yields one per step with the new `delta_*`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    # "stop" | "length" | "abort" | "error" (then `error` says what went wrong; the request
    # failed alone, the others in its batch went on)
    finish_reason: str | None = None
    index: int = 0  # which of the `n` choices
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
