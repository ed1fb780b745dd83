"""Choosing the next token from logits (numpy, on the CPU)."""

from __future__ import annotations

import numpy as np

from .types import SamplingParams


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def make_rng(params: SamplingParams) -> np.random.Generator:
    return np.random.default_rng(params.seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of logits [vocab]."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < params.top_p  # always keeps the top token
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def top_logprobs(logits: np.ndarray, chosen: int, n: int) -> dict[int, float]:
    """The top-n logprobs of the model's distribution, plus the chosen token's."""
    lp = log_softmax(logits.astype(np.float64))
    top = np.argsort(-lp, kind="stable")[:n] if n else []
    out = {int(t): float(lp[t]) for t in top}
    out.setdefault(int(chosen), float(lp[chosen]))
    return out
