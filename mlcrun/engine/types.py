"""Engine data types: what a request asks for and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import MlcrunError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    logprobs: int | None = None  # return the top-N logprobs of each generated position
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise MlcrunError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise MlcrunError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise MlcrunError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MlcrunError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise MlcrunError(f"logprobs must be in [0, 20], got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length"


class ModelRunner(Protocol):
    """What the engine needs from a model (runtime.Model implements it)."""

    @property
    def vocab_size(self) -> int: ...
    def token_embed(self, token_ids: list[int]) -> object: ...
    def batch_prefill(
        self, embeddings: object, seq_ids: list[int], lengths: list[int]
    ) -> np.ndarray: ...
    def batch_decode(self, embeddings: object, seq_ids: list[int]) -> np.ndarray: ...
    def add_new_sequence(self, seq_id: int) -> None: ...
    def remove_sequence(self, seq_id: int) -> None: ...
