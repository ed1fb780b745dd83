"""Mistral: Llama plus a sliding attention window over the last `sliding_window` keys."""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, base_kwargs


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window")
    return ModelConfig(**base_kwargs(hf), sliding_window=int(window) if window else None)
